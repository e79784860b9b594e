#!/usr/bin/python3
# fashion_mnist_ddp.py: a PyTorch (Python) version of dtrain's main job, the
# Fashion-MNIST example (examples/fashion_mnist/train.cpp, model.h), so that the
# two can be timed side by side on the same machine.
#
#   /usr/bin/python3 bench/baselines/fashion_mnist_ddp.py --nproc 2
#   /usr/bin/python3 bench/baselines/fashion_mnist_ddp.py --nproc 2 --epochs 1 --limit-batches 20
#
# The C++ job to compare with:
#
#   dtrain-run --standalone --nproc-per-node 2 dtrain-fashion-mnist --checkpoint-every 0
#
# Needs only Debian's python3-torch (written for PyTorch 1.13 and later, no
# torchrun: the ranks are started here with torch.multiprocessing.spawn, backend
# gloo over 127.0.0.1, init_method env://, USE_LIBUV=0).
#
# The same as the C++ job:
#   - model: conv1 Conv2d(1, 32, 5) -> relu -> max_pool 2; conv2 Conv2d(32, 64, 5)
#     -> relu -> max_pool 2; flatten; fc1 Linear(1024, 128) -> relu; fc2
#     Linear(128, 10) (logits); default initialization (kaiming_uniform a=sqrt(5),
#     bias U(+-1/sqrt(fan_in))) after torch.manual_seed(seed), in the same order,
#     so the initial weights are the C++ job's;
#   - loss: cross_entropy (mean over the batch); optimizer Adam(lr 1e-3,
#     betas 0.9/0.999, eps 1e-8, no weight decay), learning rate of epoch e
#     (from 0) lr * 0.7^e, set at the start of each epoch;
#   - batch 64 per rank, the last batch of an epoch partial (no drop_last);
#     epochs 5; seed 0;
#   - data: the IDX .gz files of /usr/share/datasets/fashion-mnist, pixels / 255,
#     then (x - 0.2860) / 0.3530;
#   - data order: torch.utils.data.DistributedSampler(shuffle=True, seed=0,
#     drop_last=False), set_epoch(epoch) each epoch. dtrain's DistributedSampler
#     (src/data/partition.cpp) implements the same algorithm: randperm(N) on a
#     CPU generator seeded seed + epoch, padded by repeating its head, rank r
#     takes entries r, r + world, ... So each rank sees the same samples in the
#     same order, provided both sides run the same libtorch version (ATen's
#     randperm kernel; Debian's libtorch and python3-torch come from one source).
#   - DDP over all ranks (default bucket sizes: 1 MiB first bucket, then 25 MiB;
#     gradients averaged); the initial state is broadcast from rank 0;
#   - threads: --threads intra-op threads per rank (default 1, as train.cpp's
#     --threads sets with torch::set_num_threads); OMP_NUM_THREADS=1 in the
#     ranks' environment when nproc > 1 and it is not already set (what
#     dtrain-run does); inter-op threads are left at ATen's default, as the C++
#     job does, unless --interop-threads is given;
#   - timing: an epoch's seconds run from the start of the loop over the training
#     batches (the sampler's permutation and the per-sample batching included)
#     to its end; samples/s = steps * batch * world / seconds (the partial last
#     batch counted as full, as the C++ job counts it); evaluation is outside it;
#   - evaluation after each epoch: rank r scores test images r, r + world, ... in
#     chunks of 1000 with the bare model (not the DDP wrapper), counts summed
#     with all_reduce; train loss = sum of all ranks' batch losses / their steps;
#   - the printed lines follow the C++ job's (training on..., epoch e/E: ...,
#     done: ... parameters crc32 ...).
#
# Not the same:
#   - the process group: PyTorch's gloo here; the C++ job's default backend
#     "auto" is dtrain's shared-memory backend on one machine ("--backend gloo"
#     there is an alias of dtrain's own tcp backend, not Gloo);
#   - the C++ job writes a distributed checkpoint every 200 steps (inside the
#     timed epoch loop; pass --checkpoint-every 0 to leave it out) and after
#     every epoch (outside the timed part), and a metrics file and a plot;
#     nothing of that here;
#   - the C++ job prints a progress line every tenth of an epoch (rank 0); none here;
#   - batching: torch.utils.data.DataLoader(num_workers=0) over a TensorDataset
#     (per-sample __getitem__ and default_collate in Python) versus libtorch's
#     DataLoader with workers(0) and Stack<> (per-sample get() in C++);
#   - the Adam and DDP implementations are PyTorch's, not dtrain's: the losses
#     and the final parameter checksum may differ in the last bits;
#   - --limit-batches (stop each epoch after N steps) has no C++ flag; the
#     nearest there is --train-limit N * batch * world. --train-limit and
#     --test-limit here mean what they mean in the C++ job.
#   - "total train seconds" (the sum of the epochs' seconds) and "threads: ..."
#     are printed only here.

import argparse
import gzip
import math
import os
import socket
import struct
import sys
import time
import zlib

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

DATA_DIR = "/usr/share/datasets/fashion-mnist"
MEAN, STD = 0.2860, 0.3530  # dtrain::FashionMNISTOptions' defaults
IMAGES_MAGIC, LABELS_MAGIC = 0x00000803, 0x00000801


class ConvNet(nn.Module):
    """examples/fashion_mnist/model.h, layer for layer."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 5)
        self.conv2 = nn.Conv2d(32, 64, 5)
        self.fc1 = nn.Linear(64 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)  # 32 x 12 x 12
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # 64 x 4 x 4
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)  # logits


def read_idx_gz(path, magic, count, item_shape):
    """An IDX file of unsigned bytes (gzip'ed) as a uint8 tensor [count, *item_shape]."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    dims = len(item_shape) + 1
    header = 4 + 4 * dims
    if len(data) < header:
        raise ValueError(f"{path}: truncated IDX header")
    got_magic = struct.unpack(">I", data[:4])[0]
    if got_magic != magic:
        raise ValueError(f"{path}: magic {got_magic:#010x}, expected {magic:#010x}")
    shape = struct.unpack(">" + "I" * dims, data[4:header])
    if shape[0] != count or tuple(shape[1:]) != tuple(item_shape):
        raise ValueError(f"{path}: shape {shape}, expected {(count,) + tuple(item_shape)}")
    n = math.prod(shape)
    if len(data) - header != n:
        raise ValueError(f"{path}: {len(data) - header} bytes of data, expected {n}")
    # bytearray: frombuffer wants a writable buffer (no warning).
    return torch.frombuffer(bytearray(data[header:]), dtype=torch.uint8).view(*shape)


def load_fashion_mnist(root, train):
    """(images float [N, 1, 28, 28] normalized as the C++ example does, targets int64 [N])."""
    prefix, count = ("train", 60000) if train else ("t10k", 10000)
    labels = read_idx_gz(os.path.join(root, f"{prefix}-labels-idx1-ubyte.gz"), LABELS_MAGIC, count, ())
    if int(labels.max()) >= 10:
        raise ValueError(f"{prefix} labels: a label outside 0..9")
    pixels = read_idx_gz(os.path.join(root, f"{prefix}-images-idx3-ubyte.gz"), IMAGES_MAGIC, count, (28, 28))
    images = pixels.unsqueeze(1).to(torch.float32).div_(255.0)
    images.sub_(MEAN).div_(STD)
    return images, labels.to(torch.int64)


def reduce_over_ranks(values, dtype):
    t = torch.tensor(values, dtype=dtype)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def evaluate(model, images, targets, limit):
    """Rank r scores test images r, r + world, ...; returns (correct, total) over all ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n = min(limit, images.size(0)) if limit > 0 else images.size(0)
    shard = torch.arange(rank, n, world)
    correct = 0
    model.eval()
    with torch.no_grad():
        for i in range(0, shard.numel(), 1000):
            idx = shard[i:i + 1000]
            pred = model(images.index_select(0, idx)).argmax(1)
            correct += int(pred.eq(targets.index_select(0, idx)).sum())
    model.train()
    counts = reduce_over_ranks([correct, shard.numel()], torch.int64)
    return int(counts[0]), int(counts[1])


def checksum(model):
    """CRC-32 of every parameter's bytes, as the C++ job prints it."""
    crc = 0
    for p in model.parameters():
        crc = zlib.crc32(p.detach().contiguous().numpy().tobytes(), crc)
    return crc & 0xFFFFFFFF


def worker(rank, args):
    # Before any work: set_num_interop_threads fails once inter-op work has run.
    if args.interop_threads is not None:
        torch.set_num_interop_threads(args.interop_threads)
    os.environ["USE_LIBUV"] = "0"  # Debian's PyTorch 2.x is built without libuv
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(args.nproc)
    dist.init_process_group(backend="gloo", init_method="env://", rank=rank, world_size=args.nproc)
    torch.set_num_threads(args.threads)
    world = dist.get_world_size()
    leader = rank == 0

    train_images, train_targets = load_fashion_mnist(args.data_dir, train=True)
    test_images, test_targets = load_fashion_mnist(args.data_dir, train=False)
    train_size = min(args.train_limit, train_images.size(0)) if args.train_limit > 0 else train_images.size(0)
    train_set = TensorDataset(train_images[:train_size], train_targets[:train_size])
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True,
                                 seed=args.seed, drop_last=False)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=0)

    torch.manual_seed(args.seed)
    model = ConvNet()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    ddp = DistributedDataParallel(model)

    if leader:
        print(f"training on {train_size} images, {world} rank(s), batch {args.batch_size} per rank, "
              f"{args.epochs} epoch(s)", flush=True)

    total_seconds = 0.0
    last_accuracy = last_rate = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for group in opt.param_groups:
            group["lr"] = args.lr * args.lr_decay ** epoch
        start = time.perf_counter()
        trained = 0
        loss_sum = 0.0
        for data, target in loader:
            opt.zero_grad()
            loss = F.cross_entropy(ddp(data), target)
            loss.backward()
            opt.step()
            trained += 1
            loss_sum += loss.item()
            if args.limit_batches and trained >= args.limit_batches:
                break
        seconds = time.perf_counter() - start
        total_seconds += seconds
        loss_stats = reduce_over_ranks([loss_sum, float(trained)], torch.float64)
        correct, total = evaluate(model, test_images, test_targets, args.test_limit)
        last_accuracy = correct / total
        last_rate = trained * args.batch_size * world / seconds
        if leader:
            train_loss = float(loss_stats[0]) / max(1.0, float(loss_stats[1]))
            print(f"epoch {epoch + 1}/{args.epochs}: train loss {train_loss:.4f}, "
                  f"test accuracy {100 * last_accuracy:.2f}% ({correct}/{total}), "
                  f"{last_rate:.0f} samples/s, {seconds:.1f} s", flush=True)
    if leader:
        print(f"done: test accuracy {100 * last_accuracy:.2f}% after {args.epochs} epoch(s), "
              f"{last_rate:.0f} samples/s on {world} rank(s); parameters crc32 {checksum(model):08x}")
        print(f"total train seconds: {total_seconds:.3f}")
        print(f"threads: intra={torch.get_num_threads()} inter={torch.get_num_interop_threads()}",
              flush=True)
    dist.destroy_process_group()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def positive(text):
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def positive_float(text):
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def main():
    p = argparse.ArgumentParser(description="PyTorch DDP baseline of dtrain's Fashion-MNIST example")
    p.add_argument("--nproc", type=positive, default=2, help="ranks to start (default 2)")
    p.add_argument("--epochs", type=positive, default=5, help="epochs to train (default 5, as the C++ job)")
    p.add_argument("--threads", type=positive, default=1, help="intra-op threads per rank (default 1)")
    p.add_argument("--interop-threads", type=positive, default=None,
                   help="inter-op threads per rank (default: ATen's default, as the C++ job)")
    p.add_argument("--limit-batches", type=positive, default=None,
                   help="stop each epoch after this many steps (short runs)")
    p.add_argument("--batch-size", type=positive, default=64, help="batch size per rank (default 64)")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="learning rate of the first epoch (Adam)")
    p.add_argument("--lr-decay", type=positive_float, default=0.7,
                   help="factor applied to the learning rate after each epoch")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the data order")
    p.add_argument("--train-limit", type=int, default=0, help="use only the first N training images (0: all)")
    p.add_argument("--test-limit", type=int, default=0, help="use only the first N test images (0: all)")
    p.add_argument("--data-dir", default=DATA_DIR, help="Fashion-MNIST .gz files")
    args = p.parse_args()

    # The ranks inherit this environment (spawn starts fresh interpreters).
    os.environ["USE_LIBUV"] = "0"
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this machine
    if args.nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # as dtrain-run does
    mp.spawn(worker, args=(args,), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    sys.exit(main())
