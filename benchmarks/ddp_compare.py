"""Data parallel against ``torch.nn.parallel.DistributedDataParallel`` on the same work, in
the same processes, interleaved: 2 gloo processes (one thread each), MLP 512-1024-1024-10,
every update a list batch of 8 minibatches of 64 samples split round-robin across ranks.
DDP accumulates its rank's minibatches under ``no_sync`` and all-reduces (overlapped with
the last backward) before one ``SGD(fused=True)`` step; leantrain sums its rank's items'
gradients and all-reduces DDP-sized buckets as the last item's backward completes them
(``training/overlap.py``). Prints time per update, best and median ratios.

Run: .venv/bin/python benchmarks/ddp_compare.py [--steps 20] [--runs 11]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved_ratios  # noqa: E402

import leantrain as lt  # noqa: E402
from leantrain import optim  # noqa: E402


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def worker(rank: int, world: int, init: str, steps: int, runs: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(1)
        items = [(torch.randn(64, 512, generator=g), torch.randint(0, 10, (64,), generator=g)) for _ in range(32)]
        torch.manual_seed(0)
        model = mlp()
        ref = copy.deepcopy(model)
        runner = lt.Runner.from_module(model, "cross_entropy")
        cfg = lt.TrainConfig(steps=steps, batch_size=8, optimizer=optim.sgd(0.01), log_every=0,
                             measure_loss=False, replica_check=False)
        ddp = nn.parallel.DistributedDataParallel(ref)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, fused=True)

        def ours() -> None:
            lt.train_samples(runner, cfg, items, log=lambda s: None)

        def theirs() -> None:
            for s in range(steps):
                batch = [items[(s * 8 + j) % len(items)] for j in range(8)]
                mine = batch[rank::world]
                opt.zero_grad(set_to_none=True)
                for k, (x, y) in enumerate(mine):
                    sync = k == len(mine) - 1
                    with contextlib.nullcontext() if sync else ddp.no_sync():
                        # DDP averages over ranks: scale so the result is the mean over all 8 items
                        (F.cross_entropy(ddp(x), y) * (world / len(batch))).backward()
                opt.step()

        med, best, a, b = interleaved_ratios(ours, theirs, runs=runs, reps=1, warmup=1)
        if rank == 0:
            print(f"torch {torch.__version__}, {world} gloo processes x 1 thread, {steps} updates per run, {runs} runs")
            print(f"leantrain {a / steps * 1e3:7.2f} ms/update vs DistributedDataParallel {b / steps * 1e3:7.2f} "
                  f"ms/update   ratio best {best:.3f}, median {med:.3f}")
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--runs", type=int, default=11)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(2, os.path.join(tmp, "init"), args.steps, args.runs), nprocs=2, join=True)


if __name__ == "__main__":
    main()
