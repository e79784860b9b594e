"""PyTorch's side of dtrain-bench checkpoint (bench/checkpoint.cpp): the
same wide MLP (LAYERS square Linear layers of WIDTH with ReLU, a Linear head
to 10, log-softmax), Adam, under DDP or FSDP (fully_shard per layer), one
rank of WORLD_SIZE on gloo; torch.distributed.checkpoint's save() beside its
async_save() (a gloo group of its own for the background save, as
torchtitan makes), and steps while the asynchronous one runs.

  python3 checkpoint_vs_pytorch.py ddp|fsdp DIR LAYERS WIDTH SAVES STEPS

async_save as it comes: it stages into fresh CPU memory each time. (Its
BlockingAsyncStager with cache_staged_state_dict, which would keep the
buffers as dtrain's async_save does, pins them, which needs an accelerator:
on a CPU-only machine it fails with "Cannot access accelerator device".)

Rank 0 prints the slowest rank's medians in dtrain-bench's result line.
"""
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict


class WideMlp(torch.nn.Module):
    def __init__(self, layers, width):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x):
        for b in self.blocks:
            x = F.relu(b(x))
        return F.log_softmax(self.head(x), 1)


def main():
    mode, root = sys.argv[1], sys.argv[2]
    layers, width, saves, steps = (int(v) for v in sys.argv[3:7])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    writer_group = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    net = WideMlp(layers, width)
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(net)
    else:
        from torch.distributed.fsdp import fully_shard
        for b in net.blocks:
            fully_shard(b)
        model = fully_shard(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x, y = torch.randn(8, width), torch.randint(0, 10, (8,))

    def step():
        opt.zero_grad()
        F.nll_loss(model(x), y).backward()
        opt.step()

    def timed(fn):
        t0 = time.perf_counter()
        result = fn()
        return time.perf_counter() - t0, result

    step()
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    state_bytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    plain, save, stall, write, during = [], [], [], [], []
    first_stall = 0.0
    for _ in range(steps):
        dist.barrier()
        plain.append(timed(step)[0])
    for i in range(saves):
        dist.barrier()
        save.append(timed(lambda: dcp.save(state, checkpoint_id=f"{root}/sync"))[0])
        step()
    for i in range(saves + 1):
        dist.barrier()
        t0 = time.perf_counter()
        s, future = timed(lambda: dcp.async_save(state, checkpoint_id=f"{root}/async",
                                                 process_group=writer_group))
        if i == 0:
            first_stall = s
        else:
            stall.append(s)
        writing = torch.ones(1, dtype=torch.int32)
        while True:
            dist.all_reduce(writing, op=dist.ReduceOp.MAX)
            if writing.item() == 0:
                break
            during.append(timed(step)[0])
            writing.fill_(0 if future.done() else 1)
        write.append(time.perf_counter() - t0)
        future.result()
    figures = torch.tensor([statistics.median(plain), statistics.median(save), first_stall,
                            statistics.median(stall), statistics.median(write), statistics.median(during),
                            float(len(during)), float(state_bytes)], dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        v = figures.tolist()
        print(f"result step={v[0]:.4f} save={v[1]:.4f} first_stall={v[2]:.4f} stall={v[3]:.4f} "
              f"write={v[4]:.4f} step_during={v[5]:.4f} steps_during={v[6]:.0f} state_bytes={v[7]:.0f}",
              flush=True)
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        yield local
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


if __name__ == "__main__":
    main()
