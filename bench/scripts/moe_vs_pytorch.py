#!/usr/bin/env python3
"""A mixture-of-experts block in plain PyTorch, in one process on the whole
batch: the reference for dtrain's expert_parallel.h at EP 1, 2 and 4
(dtrain-bench rank moe-ref; run both with moe_vs_pytorch.sh).

  moe_vs_pytorch.py run OUT                 the reference, to OUT
  moe_vs_pytorch.py compare DTRAIN OUT W    dtrain's W ranks against it

The algorithm, written from the papers' and torchtitan's description: sigmoid
scores of a bias-free gate; each token's top 2 experts by score + bias (the
bias chooses only); their scores divided by their sum; SwiGLU experts
w2 (silu(x w1^T) * (x w3^T)); a shared SwiGLU expert added; y = x + that.
After each AdamW step the bias moves by 1e-3 * sign(mean count - count),
centred. Values and data come from the formulas moe_ref.cpp repeats."""
import math
import os
import sys

import torch
import torch.nn.functional as F

STEPS, SEQUENCES, SEQ, DIM, HIDDEN, EXPERTS, TOP_K = 5, 8, 4, 16, 32, 8, 2
SHAPES = {  # whole shapes, by name; sorted order gives each its formula's k
    "experts.w1": (EXPERTS, HIDDEN, DIM),
    "experts.w2": (EXPERTS, DIM, HIDDEN),
    "experts.w3": (EXPERTS, HIDDEN, DIM),
    "router.gate.weight": (EXPERTS, DIM),
    "shared_expert.w1.weight": (HIDDEN, DIM),
    "shared_expert.w2.weight": (DIM, HIDDEN),
    "shared_expert.w3.weight": (HIDDEN, DIM),
}


def formula(k, shape):
    n = math.prod(shape)
    wave = (torch.arange(n, dtype=torch.float32) * (0.37 + 0.013 * k) + k).sin().reshape(shape)
    return wave / math.sqrt(shape[-1])


def data(step):
    n = SEQUENCES * SEQ * DIM
    x = (torch.arange(n, dtype=torch.float32) * 0.05 + step).sin().reshape(SEQUENCES, SEQ, DIM)
    y = (torch.arange(n, dtype=torch.float32) * 0.07 + 2 * step).cos().reshape(SEQUENCES, SEQ, DIM) * 0.5
    return x, y


def swiglu(x, w1, w2, w3):
    return (F.silu(x @ w1.t()) * (x @ w3.t())) @ w2.t()


def block(p, bias, x):
    flat = x.reshape(-1, DIM)
    scores = torch.sigmoid(flat @ p["router.gate.weight"].t())
    chosen = torch.topk(scores.detach() + bias, TOP_K, dim=1).indices
    weights = scores.gather(1, chosen)
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    out = torch.zeros_like(flat)
    for e in range(EXPERTS):
        token, slot = (chosen == e).nonzero(as_tuple=True)
        y = swiglu(flat[token], p["experts.w1"][e], p["experts.w2"][e], p["experts.w3"][e])
        out = out.index_add(0, token, y * weights[token, slot].unsqueeze(1))
    out = out + swiglu(flat, p["shared_expert.w1.weight"], p["shared_expert.w2.weight"],
                       p["shared_expert.w3.weight"])
    counts = torch.bincount(chosen.reshape(-1), minlength=EXPERTS).float()
    return x + out.reshape(x.shape), counts


def write(path, t):
    t.detach().to(torch.float32).contiguous().numpy().tofile(path)


def run(out):
    torch.set_num_threads(1)
    os.makedirs(out, exist_ok=True)
    p = {name: formula(k, shape).requires_grad_(True) for k, (name, shape) in enumerate(sorted(SHAPES.items()))}
    bias = torch.zeros(EXPERTS)
    opt = torch.optim.AdamW(list(p.values()), lr=1e-3)
    losses = []
    for step in range(STEPS):
        x, y = data(step)
        opt.zero_grad()
        output, counts = block(p, bias, x)
        loss = F.mse_loss(output, y)
        loss.backward()
        losses.append(loss.detach().reshape(1))
        if step == 0:
            write(f"{out}/output", output)
            for name, v in p.items():
                write(f"{out}/grad.{name}", v.grad)
        opt.step()
        delta = 1e-3 * torch.sign(counts.mean() - counts)
        bias += delta - delta.mean()
    write(f"{out}/loss", torch.cat(losses))
    for name, v in p.items():
        write(f"{out}/param.{name}", v)
    write(f"{out}/bias", bias)


def read(path, shape):
    import numpy
    return torch.from_numpy(numpy.fromfile(path, dtype=numpy.float32)).reshape(shape)


def compare(dtrain, ref, world):
    """Largest difference of each quantity as a fraction of its largest value."""
    worst = 0.0
    rows = SEQUENCES // world

    def check(what, got, want):
        nonlocal worst
        d = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
        worst = max(worst, d)
        if d > 1e-5:
            print(f"  {what}: {d:.3g} of its largest value")

    want_loss = read(f"{ref}/loss", (STEPS,))
    want_out = read(f"{ref}/output", (SEQUENCES, SEQ, DIM))
    for r in range(world):
        d = f"{dtrain}/rank{r}"
        check(f"rank {r} losses", read(f"{d}/loss", (STEPS,)), want_loss)
        check(f"rank {r} output", read(f"{d}/output", (rows, SEQ, DIM)), want_out[r * rows:(r + 1) * rows])
        for name, shape in SHAPES.items():
            part = list(shape)
            lo = 0
            if name.startswith("experts."):
                part[0] = EXPERTS // world
                lo = r * part[0]
            for kind in ("grad", "param"):
                want = read(f"{ref}/{kind}.{name}", shape)
                check(f"rank {r} {kind}.{name}", read(f"{d}/{kind}.{name}", tuple(part)), want[lo:lo + part[0]])
        check(f"rank {r} bias", read(f"{d}/bias", (EXPERTS,)), read(f"{ref}/bias", (EXPERTS,)))
    # The data must route no token of some rank to some expert: the case
    # where trainers shipped NaNs and missing gradients.
    idle = [(r, e) for r in range(world) for e, n in enumerate(read(f"{dtrain}/rank{r}/counts", (EXPERTS,)).tolist())
            if n == 0]
    print(f"  EP {world}: largest difference {worst:.3g} of the largest value (limit 1e-5); "
          f"{len(idle)} (rank, expert) pairs with no token in the first step")
    if world > 1 and not idle:
        print("  the data routes a token of every rank to every expert: the zero-token case is not covered")
        return False
    return worst <= 1e-5


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2])
    else:
        sys.exit(0 if compare(sys.argv[2], sys.argv[3], int(sys.argv[4])) else 1)
