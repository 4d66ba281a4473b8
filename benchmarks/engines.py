"""``engine="ddp"`` against a hand-written ``DistributedDataParallel`` loop on the same work, in
the same processes, interleaved (#69): 2 gloo processes x 1 thread, nanoGPT's GPT (from
``gpu.py``: tied head) at 4 layers, 128 wide, 64 tokens, vocab 512; every update a list
batch of 4 items of 4 sequences, 2 items per rank; AdamW.

The hand loop is what a torch user writes: ``DistributedDataParallel(model)``, ``no_sync``
for all but the rank's last item, each item's loss times ``world / n`` (DDP averages over
ranks), ``torch.optim.AdamW(fused=True)``. leantrain runs ``train_samples`` with
``engine="ddp"`` (torch's wrapper and all-reduce, leantrain's loop) and, for the same work,
its own engine (``engine="leantrain"``). Prints time per update, the median of the runs'
ratios and the best of N (each side's fastest run).

``--memory``: each side alone, in fresh processes, the peak resident memory its run adds
to each rank (Linux's high-water mark, after the model and data are built).

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/engines.py [--steps 10] [--runs 7] [--memory]
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
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved_ratios  # noqa: E402
from gpu import GPT, GPTConfig, gpt_loss  # noqa: E402

import leantrain as lt  # noqa: E402

CONFIG = GPTConfig(block_size=64, vocab_size=512, n_layer=4, n_head=4, n_embd=128)
ITEMS = 4  # items per update (2 per rank)


def work() -> tuple:
    """The data (16 items of 4 sequences) and the model, the same on every rank and side."""
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(16):
        x = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.block_size), generator=g)
        data.append((x, torch.roll(x, -1, 1)))
    torch.manual_seed(0)
    return data, GPT(CONFIG)


def hand_update(ddp, opt, data: list, s: int, rank: int, world: int) -> None:
    """The hand loop's update ``s``: this rank's items, no_sync but for its last, loss x world / n."""
    mine = [data[(s * ITEMS + j) % len(data)] for j in range(ITEMS)][rank::world]
    opt.zero_grad(set_to_none=True)
    for k, (x, y) in enumerate(mine):
        with contextlib.nullcontext() if k == len(mine) - 1 else ddp.no_sync():
            (gpt_loss(ddp(x), y) * (world / ITEMS)).backward()
    opt.step()


def worker(rank: int, world: int, init: str, steps: int, runs: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        data, model = work()
        hand, own = copy.deepcopy(model), copy.deepcopy(model)
        sides = {}
        for name, m, engine in (("ddp", model, "ddp"), ("leantrain", own, "leantrain")):
            runner = lt.Runner.from_module(m, gpt_loss)
            cfg = lt.TrainConfig(steps=steps, batch_size=ITEMS, optimizer=lt.optim.adamw(3e-4), log_every=0,
                                 measure_loss=False, replica_check=False, engine=engine)
            sides[name] = (lambda r=runner, c=cfg: lt.train_samples(r, c, data, log=lambda s: None))
        ddp = nn.parallel.DistributedDataParallel(hand)
        opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4, fused=True)

        def theirs() -> None:
            for s in range(steps):
                hand_update(ddp, opt, data, s, rank, world)

        for name in ("ddp", "leantrain"):
            med, best, a, b = interleaved_ratios(sides[name], theirs, runs=runs, reps=1, warmup=1)
            if rank == 0:
                print(f"engine={name!r:12} {a / steps * 1e3:7.2f} ms/update vs hand DDP loop {b / steps * 1e3:7.2f} "
                      f"ms/update   ratio median {med:.3f}, best {best:.3f}", flush=True)
        if rank == 0:
            print(f"torch {torch.__version__}, {world} gloo processes x 1 thread, {steps} updates per run, {runs} runs, "
                  f"{sum(p.numel() for p in model.parameters()):,} parameters")
    finally:
        dist.destroy_process_group()


def peak_worker(rank: int, world: int, init: str, steps: int, side: str, out: str) -> None:
    """One side alone in fresh processes: the peak resident memory a run adds to a rank
    (Linux's high-water mark after the run minus before it, the model and data built)."""
    import resource

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        data, model = work()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if side == "hand":
            ddp = nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4, fused=True)
            for s in range(steps):
                hand_update(ddp, opt, data, s, rank, world)
        else:
            cfg = lt.TrainConfig(steps=steps, batch_size=ITEMS, optimizer=lt.optim.adamw(3e-4), log_every=0,
                                 measure_loss=False, replica_check=False, engine=side)
            lt.train_samples(lt.Runner.from_module(model, gpt_loss), cfg, data, log=lambda s: None)
        added = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        with open(os.path.join(out, f"{side}.{rank}"), "w") as f:
            f.write(str(added))
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--memory", action="store_true", help="peak memory per rank instead: each side alone")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if not args.memory:
            mp.spawn(worker, args=(2, os.path.join(tmp, "init"), args.steps, args.runs), nprocs=2, join=True)
            return
        for side in ("hand", "ddp", "leantrain"):
            mp.spawn(peak_worker, args=(2, os.path.join(tmp, f"init-{side}"), args.steps, side, tmp), nprocs=2,
                     join=True)
            added = [int(open(os.path.join(tmp, f"{side}.{r}")).read()) / 1024 for r in range(2)]
            name = "hand DDP loop" if side == "hand" else f"engine={side!r}"
            print(f"{name:20} peak resident memory a run adds, per rank: "
                  f"{', '.join(f'{m:.1f} MiB' for m in added)}", flush=True)


if __name__ == "__main__":
    main()
