"""PyTorch's tensor parallelism (parallelize_module with ColwiseParallel,
RowwiseParallel, SequenceParallel, PrepareModuleInput and loss_parallel;
torch.utils.checkpoint) on the models, initial values and data of
dtrain-bench's tp-ref mode (bench/tensor_parallel_ref.cpp), or the
comparison of both runs' files.

  python3 tp_vs_pytorch.py run OUT              one rank (RANK, WORLD_SIZE, MASTER_* set)
  python3 tp_vs_pytorch.py compare DTRAIN TORCH WORLD
"""
import math
import os
import sys

import torch
import torch.nn.functional as F

STEPS, BATCH, SEQ = 5, 2, 8
VOCAB, DIM, LAYERS, HEADS, HIDDEN = 64, 32, 2, 4, 64
VARIANTS = ["mlp", "llama", "llama-sp", "llama-ac"]


def formula(k, like, norm):
    wave = (torch.arange(like.numel(), dtype=torch.float32) * (0.37 + 0.013 * k) + k).sin().reshape(like.shape)
    if norm:
        return 1 + 0.2 * wave
    return wave / math.sqrt(like.shape[1] if like.dim() > 1 else like.shape[0])


def set_formula_values(model):
    with torch.no_grad():
        for k, (name, p) in enumerate(sorted(model.named_parameters())):
            p.copy_(formula(k, p, name.endswith("norm.weight")))


# ---- the models ---------------------------------------------------------------

class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class RMSNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(DIM))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


def rotate(x, cos, sin):  # [batch, sequence, heads, head_dim], pairs (2i, 2i + 1)
    s = x.shape[1]
    pairs = x.unflatten(-1, (x.shape[-1] // 2, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    c, n = cos[:s].view(1, s, 1, -1), sin[:s].view(1, s, 1, -1)
    return torch.stack([even * c - odd * n, even * n + odd * c], -1).flatten(-2)


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for w in ("wq", "wk", "wv", "wo"):
            setattr(self, w, torch.nn.Linear(DIM, DIM, bias=False))
        hd = DIM // HEADS
        inverse = 1.0 / torch.pow(10000.0, torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        angles = torch.outer(torch.arange(SEQ, dtype=torch.float32), inverse)
        self.cos, self.sin = angles.cos(), angles.sin()

    def forward(self, x):
        q, k, v = self.wq(x), self.wk(x), self.wv(x)  # local tensors: this rank's heads
        b, s, hd = q.shape[0], q.shape[1], DIM // HEADS
        heads = lambda t: t.view(b, s, -1, hd)
        q = rotate(heads(q), self.cos, self.sin).transpose(1, 2)
        k = rotate(heads(k), self.cos, self.sin).transpose(1, 2)
        v = heads(v).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(hd)
        future = torch.ones(s, s, dtype=torch.bool).triu(1)
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), -1)
        return self.wo((probs @ v).transpose(1, 2).reshape(b, s, -1))


class FeedForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = torch.nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = torch.nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(), Attention()
        self.ffn_norm, self.feed_forward = RMSNorm(), FeedForward()

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(torch.nn.Module):
    def __init__(self, checkpoint):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = RMSNorm()
        self.output = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.checkpoint = checkpoint

    def forward(self, tokens):
        from torch.utils.checkpoint import checkpoint
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=True) if self.checkpoint else layer(x)
        return self.output(self.norm(x))


# ---- PyTorch's plans (torchtitan's for Llama) -----------------------------------

def parallelize(model, variant, mesh):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    if variant == "mlp":
        return parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    sp = variant == "llama-sp"
    seq = Shard(1) if sp else Replicate()
    top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
           "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)}
    if sp:
        top["norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    for layer in model.layers:
        plan = {f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
        plan.update({f"feed_forward.{w}": ColwiseParallel() for w in ("w1", "w3")})
        plan["attention.wo"] = RowwiseParallel(output_layouts=seq)
        plan["feed_forward.w2"] = RowwiseParallel(output_layouts=seq)
        if sp:
            for norm, inner in (("attention_norm", "attention"), ("ffn_norm", "feed_forward")):
                plan[norm] = SequenceParallel()
                plan[inner] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        parallelize_module(layer, mesh, plan)
    return model


# ---- the data, as tensor_parallel_ref.cpp makes it ---------------------------------

def mlp_input(step):
    return (torch.arange(BATCH * SEQ * 16, dtype=torch.float32) * 0.05 + step).sin().reshape(BATCH, SEQ, 16)


def mlp_target(step):
    return (torch.arange(BATCH * SEQ * 16, dtype=torch.float32) * 0.07 + 2 * step).cos().reshape(BATCH, SEQ, 16) * 0.5


def tokens(step, shift):
    return ((torch.arange(BATCH * SEQ) * 7 + 3 * step + shift) % VOCAB).reshape(BATCH, SEQ)


def local(t):
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def write(path, t):
    with open(path, "wb") as f:
        f.write(local(t).detach().float().contiguous().numpy().tobytes())


def run_variant(variant, mesh, out):
    from torch.distributed.tensor.parallel import loss_parallel
    model = Mlp() if variant == "mlp" else Llama(checkpoint=variant == "llama-ac")
    set_formula_values(model)
    model = parallelize(model, variant, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rank = torch.distributed.get_rank()
    d = f"{out}/{variant}/rank{rank}"
    os.makedirs(d, exist_ok=True)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        if variant == "mlp":
            output = model(mlp_input(step))
            loss = F.mse_loss(output, mlp_target(step))
            loss.backward()
        else:
            output = model(tokens(step, 0))
            with loss_parallel():
                loss = F.cross_entropy(output.flatten(0, 1), tokens(step, 1).flatten(0, 1))
                loss.backward()
        losses.append(local(loss).detach().reshape(1))
        if step == 0:
            write(f"{d}/output", output)
            for name, p in model.named_parameters():
                grad = p.grad.redistribute(p.device_mesh, p.placements) if hasattr(p.grad, "redistribute") else p.grad
                write(f"{d}/grad.{name}", grad)
        opt.step()
    write(f"{d}/loss", torch.cat(losses))
    for name, p in model.named_parameters():
        write(f"{d}/param.{name}", p)


def run(out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for variant in VARIANTS:
        run_variant(variant, mesh, out)
    dist.destroy_process_group()


# ---- the comparison ------------------------------------------------------------

def read(path):
    return torch.frombuffer(bytearray(open(path, "rb").read()), dtype=torch.float32)


def largest_relative(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def compare_variant(mine, theirs, variant, world):
    """Per kind of file (output, loss, grad, param), the largest difference
    over the ranks as a fraction of the largest value."""
    worst = {}
    for rank in range(world):
        d = f"{mine}/{variant}/rank{rank}"
        names = sorted(os.listdir(d))
        if sorted(os.listdir(f"{theirs}/{variant}/rank{rank}")) != names:
            sys.exit(f"{variant} rank {rank}: dtrain and PyTorch wrote different files")
        for name in names:
            a, b = read(f"{d}/{name}"), read(f"{theirs}/{variant}/rank{rank}/{name}")
            if a.numel() != b.numel():
                sys.exit(f"{variant} rank {rank} {name}: {a.numel()} values from dtrain, {b.numel()} from PyTorch")
            kind = name.split(".")[0]
            worst[kind] = max(worst.get(kind, 0.0), largest_relative(a, b))
    return worst


def bitwise_equal(root, a, b, world):
    """One side's runs of variants a and b: every loss and gradient equal."""
    for rank in range(world):
        for name in os.listdir(f"{root}/{a}/rank{rank}"):
            if name.startswith(("loss", "grad.")) and not torch.equal(
                    read(f"{root}/{a}/rank{rank}/{name}"), read(f"{root}/{b}/rank{rank}/{name}")):
                return False
    return True


def compare(mine, theirs, world):
    ok = True
    for variant in VARIANTS:
        worst = compare_variant(mine, theirs, variant, world)
        bound = 1e-5
        line = ", ".join(f"{k} {v:.2g}" for k, v in sorted(worst.items()))
        good = max(worst.values()) <= bound
        ok &= good
        print(f"  TP {world} {variant:9s} {line}: {'within' if good else 'NOT within'} {bound:g}")
    # Each side's checkpointed run is its plain run, bit for bit: so dtrain's
    # activation checkpointing differs from torch.utils.checkpoint by exactly
    # what the models without it differ by (the line for llama above).
    for side, root in (("dtrain", mine), ("PyTorch", theirs)):
        same = bitwise_equal(root, "llama", "llama-ac", world)
        ok &= same
        print(f"  TP {world} {side} with activation checkpointing against without: losses and gradients "
              f"{'bitwise equal' if same else 'DIFFER'}")
    return ok


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2])
    else:
        sys.exit(0 if compare(sys.argv[2], sys.argv[3], int(sys.argv[4])) else 1)
