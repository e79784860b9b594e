#!/usr/bin/env python3
"""Context parallelism against PyTorch: F.scaled_dot_product_attention over
the whole sequence in one process (causal, grouped-query) against dtrain's
ring and Ulysses attention at CP 2 and 4 (bench/cp_ref.cpp), from the same
formula for q, k, v and the upstream gradient.

  cp_vs_pytorch.py compare DTRAIN_OUT WORLD SEQ

reads every rank's parts of the output and of q, k and v's gradients,
puts them back in sequence order (head-tail: rank r holds chunks r and
2c - 1 - r of 2c), and prints the largest difference of each as a fraction
of its largest value; exits 1 above 1e-5.
"""

import sys

import numpy
import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
LIMIT = 1e-5


def formula(k, heads, seq):
    """The formula cp_ref.cpp repeats: sin(0.37 i + k), i the flat index."""
    i = torch.arange(heads * seq * HEAD_DIM, dtype=torch.float64)
    return (i * 0.37 + k).sin().to(torch.float32).reshape(1, heads, seq, HEAD_DIM)


def reference(seq):
    q, k, v = (formula(n, h, seq).requires_grad_(True) for n, h in ((0, HEADS), (1, KV_HEADS), (2, KV_HEADS)))
    # The math kernel: the reference the others are checked against.
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (out * formula(3, HEADS, seq)).sum().backward()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def unshard(parts, world):
    """Every rank's part (head-tail) back in sequence order along dim 2."""
    chunks = [None] * (2 * world)
    for r, part in enumerate(parts):
        early, late = part.chunk(2, dim=2)
        chunks[r], chunks[2 * world - 1 - r] = early, late
    return torch.cat(chunks, dim=2)


def compare(dtrain, world, seq):
    want = reference(seq)
    heads = {"out": HEADS, "dq": HEADS, "dk": KV_HEADS, "dv": KV_HEADS}
    ok = True
    for method in ("ring", "ulysses"):
        worst = 0.0
        for what, h in heads.items():
            parts = [torch.from_numpy(numpy.fromfile(f"{dtrain}/rank{r}/{method}.{what}", dtype=numpy.float32))
                     .reshape(1, h, seq // world, HEAD_DIM) for r in range(world)]
            got = unshard(parts, world)
            d = (got - want[what]).abs().max().item() / max(want[what].abs().max().item(), 1e-12)
            worst = max(worst, d)
            if d > LIMIT:
                print(f"  {method} at CP {world}: {what} differs by {d:.3g} of its largest value")
                ok = False
        print(f"  {method} at CP {world}, sequence {seq}: output and q, k, v gradients within {worst:.3g} "
              f"of the largest value (limit {LIMIT:g})")
    return ok


if __name__ == "__main__":
    torch.set_num_threads(2)
    sys.exit(0 if compare(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])) else 1)
