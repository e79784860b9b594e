"""PyTorch's torch.distributed.pipelining on the model and data of
dtrain-bench's pp-ref mode (bench/pipeline.cpp), or the comparison of both.

  python3 pipeline_vs_pytorch.py run SCHEDULE OUT      one rank (RANK, MASTER_* set)
  python3 pipeline_vs_pytorch.py compare DTRAIN TORCH  largest difference, per rank file
"""
import os
import sys

import torch
import torch.nn.functional as F

WIDTH, ROWS = 16, 8


def reference_model():
    layers = []
    with torch.no_grad():
        for i in range(4):
            lin = torch.nn.Linear(WIDTH, WIDTH)
            lin.weight.copy_((torch.arange(WIDTH * WIDTH) * 0.37 + i).sin().reshape(WIDTH, WIDTH) * 0.25)
            lin.bias.copy_((torch.arange(WIDTH) * 0.11 + i).cos() * 0.1)
            layers += [lin, torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def reference_input(step):
    return (torch.arange(ROWS * WIDTH) * 0.05 + step).sin().reshape(ROWS, WIDTH)


def reference_target(step):
    return (torch.arange(ROWS * WIDTH) * 0.07 + 2 * step).cos().reshape(ROWS, WIDTH) * 0.5


def run(schedule, out):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = reference_model()
    piece = torch.nn.Sequential(*list(model)[4 * rank:4 * rank + 4])
    stage = PipelineStage(piece, rank, 2, torch.device("cpu"))
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = kind(stage, n_microbatches=4, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(piece.parameters(), lr=0.5)
    for step in range(5):
        opt.zero_grad()
        if rank == 0:
            sched.step(reference_input(step))
        else:
            sched.step(target=reference_target(step), losses=[])
        opt.step()
    with open(f"{out}.{rank}", "wb") as f:
        for p in piece.parameters():
            f.write(p.detach().contiguous().numpy().tobytes())
    dist.destroy_process_group()


def compare(mine, theirs):
    worst = 0.0
    for rank in range(2):
        a = torch.frombuffer(bytearray(open(f"{mine}.{rank}", "rb").read()), dtype=torch.float32)
        b = torch.frombuffer(bytearray(open(f"{theirs}.{rank}", "rb").read()), dtype=torch.float32)
        if a.numel() != b.numel():
            sys.exit(f"rank {rank}: {a.numel()} parameters from dtrain, {b.numel()} from PyTorch")
        rel = ((a - b).abs().max() / b.abs().max()).item()
        moved = ((b - reference_flat(rank)).abs().max()).item()
        print(f"  stage {rank}: largest difference {rel:.3g} of the largest value "
              f"(training moved the parameters by up to {moved:.3g})")
        worst = max(worst, rel)
    return worst


def reference_flat(rank):
    piece = list(reference_model())[4 * rank:4 * rank + 4]
    return torch.cat([p.detach().reshape(-1) for m in piece for p in m.parameters()])


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3])
    else:
        worst = compare(sys.argv[2], sys.argv[3])
        print(f"  worst {worst:.3g}: {'within' if worst <= 1e-5 else 'NOT within'} 1e-5")
        sys.exit(0 if worst <= 1e-5 else 1)
