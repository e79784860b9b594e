"""PyTorch's side of `dtrain-bench tp --run ac`: the same 8 blocks
(x + down(gelu(up(LayerNorm(x))))), width 256, 2048 tokens, one thread,
and the same measure (peak RSS in a step minus the RSS before it, with
malloc returning blocks of 64 KiB or more to the kernel), without
checkpointing, with torch.utils.checkpoint around each block, and with
selective checkpointing keeping the matrix multiplies' outputs
(create_selective_checkpoint_contexts, MUST_SAVE for mm and addmm).
Each mode runs in a process of its own.

  python3 bench/scripts/sac_pytorch_memory.py [--width 256] [--seq 2048]
"""

import argparse
import functools
import os
import subprocess
import sys

import torch
import torch.nn as nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)


def vm(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


class Block(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(w), nn.Linear(w, 4 * w), nn.Linear(4 * w, w)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def keep_matmuls(ctx, op, *args, **kwargs):
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def one(mode, width, seq):
    torch.set_num_threads(1)
    blocks = nn.ModuleList(Block(width) for _ in range(8))
    adam = torch.optim.Adam(blocks.parameters(), lr=1e-3)
    x = torch.randn(1, seq, width)
    context = functools.partial(create_selective_checkpoint_contexts, keep_matmuls)

    def step():
        adam.zero_grad()
        h = x
        for b in blocks:
            if mode == "none":
                h = b(h)
            elif mode == "full":
                h = checkpoint(b, h, use_reentrant=False)
            else:
                h = checkpoint(b, h, use_reentrant=False, context_fn=context)
        h.pow(2).mean().backward()
        adam.step()

    step()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    resting = vm("VmRSS:")
    step()
    print(vm("VmHWM:") - resting)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mode")
    a = p.parse_args()
    if a.mode:
        one(a.mode, a.width, a.seq)
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    got = {}
    for mode in ("none", "full", "selective"):
        out = subprocess.run([sys.executable, __file__, "--mode", mode, "--width", str(a.width), "--seq", str(a.seq)],
                             env=env, check=True, capture_output=True, text=True).stdout
        got[mode] = int(out.split()[-1])
    print(f"PyTorch {torch.__version__}: 8 blocks of width {a.width}, {a.seq} tokens, activation peak")
    for mode, b in got.items():
        print(f"  {mode:10s} {b / 2**20:8.1f} MiB {b / got['none']:7.3f}x")


if __name__ == "__main__":
    main()
