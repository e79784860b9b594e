"""PyTorch's side of local_sgd_vs_pytorch.sh (dtrain-bench rank local-sgd-ref
is dtrain's): the same model, data and schedules.

  rank OUT          one rank of PyTorch's post-local SGD over gloo
                    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set):
                    DDP with post_localSGD_hook, PostLocalSGDOptimizer with
                    a PeriodicModelAverager
  diloco OUT WORLD  DiLoCo and Streaming DiLoCo written out in plain PyTorch
                    in one process, replica by replica (the papers'
                    algorithms; fragments placed and delayed as torchft does)
  compare DTRAIN TORCH WORLD   largest difference of every rank's parameters
"""
import os
import sys

import torch


def net():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    with torch.no_grad():
        for k, p in enumerate(m.parameters(), start=1):
            p.copy_((torch.arange(p.numel(), dtype=torch.float32) * 0.7 + k).sin().view_as(p) * 0.5)
    return m


def batch(rank, step):
    x = (torch.arange(12, dtype=torch.float32) * (0.31 + 0.07 * rank) + step).sin().view(3, 4)
    y = (torch.arange(6, dtype=torch.float32) * (0.53 + 0.11 * rank) - step).cos().view(3, 2)
    return x, y


def write(directory, model):
    os.makedirs(directory, exist_ok=True)
    for i, p in enumerate(model.parameters()):
        p.detach().to(torch.float32).contiguous().numpy().tofile(f"{directory}/param.{i}")


def rank(out):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    r = dist.get_rank()
    model = net()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=10,
                              post_local_gradient_allreduce=False)
    ddp.register_comm_hook(state, post_localSGD_hook)
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    opt = PostLocalSGDOptimizer(optim=sgd, averager=PeriodicModelAverager(period=4, warmup_steps=10))
    for step in range(50):
        opt.zero_grad()
        x, y = batch(r, step)
        ((ddp(x) - y) ** 2).mean().backward()
        opt.step()
    write(f"{out}/rank{r}", model)
    dist.destroy_process_group()


def diloco(out, world, streaming):
    """Each replica's inner AdamW; every H steps per fragment the average
    over replicas of (global - own) is the gradient of an outer SGD with
    Nesterov momentum on the global values; applied `delay` steps after it
    was taken; the fragment then becomes (1 - alpha) global + alpha own."""
    h, delay, alpha = 4, (1 if streaming else 0), (0.5 if streaming else 0.0)
    steps = 21 if streaming else 20
    nets = [net() for _ in range(world)]
    inner = [torch.optim.AdamW(n.parameters(), lr=1e-2) for n in nets]
    glob = net()
    outer = torch.optim.SGD(glob.parameters(), lr=0.7, momentum=0.9, nesterov=True)

    def fragment(m, f):
        if not streaming:
            return list(m.parameters())
        return list(m[0].parameters()) if f == 0 else list(m[2].parameters())

    count = 2 if streaming else 1
    offsets = [h * (f + 1) // count for f in range(count)]
    pending = [None] * count
    for step in range(1, steps + 1):
        for r in range(world):
            inner[r].zero_grad()
            x, y = batch(r, step - 1)
            ((nets[r](x) - y) ** 2).mean().backward()
            inner[r].step()
        with torch.no_grad():
            for f in range(count):
                if step >= offsets[f] and (step - offsets[f]) % h == 0:
                    g = fragment(glob, f)
                    pending[f] = [sum((g[i] - fragment(nets[r], f)[i]) / world for r in range(world))
                                  for i in range(len(g))]
            for f in range(count):
                if step < offsets[f] + delay or (step - offsets[f] - delay) % h != 0:
                    continue
                for p in glob.parameters():
                    p.grad = None
                g = fragment(glob, f)
                for i, p in enumerate(g):
                    p.grad = pending[f][i].clone()
                outer.step()
                for r in range(world):
                    for own, new in zip(fragment(nets[r], f), g):
                        own.copy_(torch.lerp(new, own, alpha))
    for r in range(world):
        write(f"{out}/rank{r}", nets[r])


def compare(dtrain, ref, world):
    import numpy
    shapes = [(6, 4), (6,), (2, 6), (2,)]
    worst = 0.0
    for r in range(world):
        for i, shape in enumerate(shapes):
            def read(d):
                return torch.from_numpy(numpy.fromfile(f"{d}/rank{r}/param.{i}", dtype=numpy.float32)).reshape(shape)
            got, want = read(dtrain), read(ref)
            worst = max(worst, (got - want).abs().max().item())
    return worst


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "rank":
        rank(sys.argv[2])
    elif cmd in ("diloco", "streaming"):
        diloco(sys.argv[2], int(sys.argv[3]), cmd == "streaming")
    elif cmd == "compare":
        worst = compare(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        print(f"{worst:.3g}")
    else:
        sys.exit(f"local_sgd_vs_pytorch.py: unknown command {cmd}")
