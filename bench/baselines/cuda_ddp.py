"""PyTorch's side of `dtrain-bench cuda`: the same MLP (LAYERS Linear(WIDTH,
WIDTH)+ReLU), batch, SGD and timing as dtrain's ranks, plain and under
torch.nn.parallel.DistributedDataParallel.

World 1 uses nccl; world > 1 starts that many processes on GPU 0 (ranks
sharing one GPU) with --backend (gloo: NCCL takes one GPU per rank).
Rank 0 prints plain_step_ms=, ddp_step_ms= and ddp_samples_per_s=.
"""
import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def mlp(layers, width):
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods)


def timed(model, x, target, steps):
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), target).backward()
        opt.step()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    return time.perf_counter() - t0


def rank_main(rank, a, port):
    torch.set_num_threads(1)
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group(a.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=a.world)
    torch.manual_seed(0)
    x = torch.randn(a.batch, a.width, device=device)
    target = torch.randn(a.batch, a.width, device=device)
    plain = timed(mlp(a.layers, a.width).to(device), x, target, a.steps)
    ddp_model = torch.nn.parallel.DistributedDataParallel(mlp(a.layers, a.width).to(device))
    ddp = timed(ddp_model, x, target, a.steps)
    if rank == 0:
        print(f"result plain_step_ms={plain / a.steps * 1e3:.3f} ddp_step_ms={ddp / a.steps * 1e3:.3f} "
              f"ddp_samples_per_s={a.steps * a.batch * a.world / ddp:.1f}", flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    for k, d in (("layers", 8), ("width", 4096), ("batch", 256), ("steps", 50), ("world", 1)):
        p.add_argument("--" + k, type=int, default=d)
    p.add_argument("--backend", default="nccl")
    a = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if a.world == 1:
        rank_main(0, a, port)
    else:
        mp.spawn(rank_main, args=(a, port), nprocs=a.world)


if __name__ == "__main__":
    main()
