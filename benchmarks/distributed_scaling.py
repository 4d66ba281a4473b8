"""Samples per second of data-parallel training with 1 and 2 processes (gloo, CPU).

A compute-bound MLP (512-1024-1024-10); every update is a list batch of 8 minibatches
of 64 samples, split round-robin across the ranks; one thread per process. Prints
samples/s for each world size and the ratio, and with 2 processes the cost of
``exact_reduction`` (every item's gradient folded in item order by the owners of its ranges) against the
default all-reduce: time per update (best of ``--runs`` runs of each, alternating, and the
median of the runs' ratios) and bytes each rank receives per update.

Run: .venv/bin/python benchmarks/distributed_scaling.py [--steps 30] [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
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


def run(steps: int, exact: bool = False) -> float:
    runner = lt.Runner.from_module(model(), "cross_entropy")
    opt = optim.sgd(0.01)
    state = opt.init(runner.params)
    data = batches()
    from types import SimpleNamespace

    from leantrain.training.parallel.choose import choose
    from leantrain.training.update.options import StepOptions
    from leantrain.training.update.step import update

    options = StepOptions(reduction=choose(SimpleNamespace(exact_reduction=exact)).reduction)

    def step(state):
        return update("bench", runner, opt, state, data, options).state

    state = step(state)  # warm-up
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        state = step(state)
    if dist.is_initialized():
        dist.barrier()
    return time.perf_counter() - start


def worker(rank: int, world: int, init: str, steps: int, runs: int, q) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    times = []
    for _ in range(runs):  # interleaved: the machine's load falls on both alike
        times.append((run(steps), run(steps, exact=True)))
    if rank == 0:
        q.put(times)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--runs", type=int, default=5, help="default and exact runs, alternating")
    args = ap.parse_args()
    torch.set_num_threads(1)
    one = run(args.steps)
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    init = os.path.join(tempfile.mkdtemp(), "init")
    mp.spawn(worker, args=(2, init, args.steps, args.runs, q), nprocs=2, join=True)
    times = q.get()
    two, exact = min(t for t, _ in times), min(e for _, e in times)
    ratios = [e / t for t, e in times]
    samples = args.steps * ITEMS * BATCH
    values = sum(p.numel() for p in model().parameters())
    reduce_bytes = 4 * values  # one all-reduced float32 pack
    exact_bytes = 4 * values * (-(-ITEMS // 2) + 1)  # a pack of ranges per round of 2 items, then the sum
    print(f"MLP 512-1024-1024-10, {ITEMS} x {BATCH} samples per update, {args.steps} updates, "
          f"1 thread per process, {os.cpu_count()} cores")
    print(f"  1 process : {samples / one:9.0f} samples/s")
    print(f"  2 processes: {samples / two:9.0f} samples/s")
    print(f"  speed-up 2 vs 1 = {one / two:.2f}x")
    print(f"  exact_reduction, 2 processes (best of {args.runs}, alternating): {exact / args.steps * 1e3:.1f} ms "
          f"per update vs {two / args.steps * 1e3:.1f} ms with the all-reduce ({exact / two:.2f}x; median of the "
          f"runs' ratios {statistics.median(ratios):.2f}x); receives {exact_bytes / 2**20:.1f} MiB per update vs "
          f"{reduce_bytes / 2**20:.1f} MiB all-reduced")


if __name__ == "__main__":
    sys.exit(main())
