"""Samples per second of data-parallel training with 1 and 2 processes (gloo, CPU).

A compute-bound MLP (512-1024-1024-10); every update is a list batch of 8 minibatches
of 64 samples, split round-robin across the ranks; one thread per process. Prints
samples/s for each world size and the ratio.

Run: .venv/bin/python benchmarks/distributed_scaling.py [--steps 30]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import leantrain as lt
from leantrain import optim

ITEMS, BATCH = 8, 64


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 512, generator=g), torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(ITEMS)]


def run(steps: int) -> float:
    runner = lt.Runner.from_module(model(), "cross_entropy")
    opt = optim.sgd(0.01)
    state = opt.init(runner.params)
    data = batches()
    state = lt.step_batch(runner, opt, state, False, data)  # warm-up
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        state = lt.step_batch(runner, opt, state, False, data)
    if dist.is_initialized():
        dist.barrier()
    return time.perf_counter() - start


def worker(rank: int, world: int, init: str, steps: int, q) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    elapsed = run(steps)
    if rank == 0:
        q.put(elapsed)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    one = run(args.steps)
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    init = os.path.join(tempfile.mkdtemp(), "init")
    mp.spawn(worker, args=(2, init, args.steps, q), nprocs=2, join=True)
    two = q.get()
    samples = args.steps * ITEMS * BATCH
    print(f"MLP 512-1024-1024-10, {ITEMS} x {BATCH} samples per update, {args.steps} updates, "
          f"1 thread per process, {os.cpu_count()} cores")
    print(f"  1 process : {samples / one:9.0f} samples/s")
    print(f"  2 processes: {samples / two:9.0f} samples/s")
    print(f"  speed-up 2 vs 1 = {one / two:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
