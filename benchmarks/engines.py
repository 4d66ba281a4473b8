"""leantrain's torch engines against the hand-written torch loops on the same work, in the
same processes, interleaved (#69): 2 gloo processes (``--world``) x 1 thread, nanoGPT's GPT (from
``gpu.py``: tied head) at 4 layers, 128 wide, 64 tokens, vocab 512; every update a list
batch of 4 items of 4 sequences (2 items per rank on 2 processes, 1 on 4); AdamW.

``--against ddp`` (the default): the hand loop a torch user writes,
``DistributedDataParallel(model)``, ``no_sync`` for all but the rank's last item, each
item's loss times ``world / n`` (DDP averages over ranks), ``torch.optim.AdamW(fused=True)``;
against it ``train_samples`` with ``engine="ddp"`` and, for the same work, leantrain's own
engine (``engine="leantrain"``). ``--against fsdp2``: the hand FSDP2 loop,
``fully_shard`` on each block then the root, ``set_requires_gradient_sync(False)`` for all
but the rank's last item, loss times ``world / n``, ``torch.optim.AdamW`` on the DTensor
shards (torch's default multi-tensor kernel: ``fused`` does not take DTensors here);
against it ``engine="fsdp2"`` and ``sharding="parameters"``. Prints time per update, the
median of the runs' ratios and the best of N (each side's fastest run).

``--memory``: each side alone, in fresh processes, the peak resident memory its run adds
to each rank (Linux's high-water mark, after the model and data are built): what a first
run costs, imports and first-use set-up included. ``--warm``: what a run holds, after a
2-update run of the same side on a copy (imports and set-up done), the high-water mark
reset (``/proc/self/clear_refs``) just before the measured run. glibc keeps freed heap
memory it cannot trim in the resident set, so the high-water mark also depends on how
a side's allocations fragment the heap: ``MALLOC_TRIM_THRESHOLD_=0
MALLOC_MMAP_THRESHOLD_=65536`` in the environment (freed memory given back) leaves what
the run holds.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/engines.py [--against ddp|fsdp2] [--world 2] [--steps 10]
[--runs 7] [--memory [--warm]]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
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


def hand_fsdp2_update(model, opt, data: list, s: int, rank: int, world: int) -> None:
    """The hand FSDP2 loop's update ``s``: this rank's items, the reduce-scatter after its last."""
    mine = [data[(s * ITEMS + j) % len(data)] for j in range(ITEMS)][rank::world]
    opt.zero_grad(set_to_none=True)
    for k, (x, y) in enumerate(mine):
        model.set_requires_gradient_sync(k == len(mine) - 1)
        (gpt_loss(model(x), y) * (world / ITEMS)).backward()
    opt.step()


def hand(against: str, model):
    """The hand loop's model and optimizer (``against``: "ddp" or "fsdp2") and its update."""
    if against == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=3e-4, fused=True), hand_update
    from torch.distributed.fsdp import fully_shard

    for block in model.h:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4), hand_fsdp2_update


SIDES = {"ddp": ("ddp", "leantrain"), "fsdp2": ("fsdp2", "parameters")}


def side_config(side: str, steps: int) -> lt.TrainConfig:
    more = {"sharding": "parameters"} if side == "parameters" else {"engine": side}
    return lt.TrainConfig(steps=steps, batch_size=ITEMS, optimizer=lt.optim.adamw(3e-4), log_every=0,
                          measure_loss=False, replica_check=False, **more)


def worker(rank: int, world: int, init: str, steps: int, runs: int, against: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        data, model = work()
        sides = {}
        for name in SIDES[against]:
            runner = lt.Runner.from_module(copy.deepcopy(model), gpt_loss)
            sides[name] = (lambda r=runner, c=side_config(name, steps): lt.train_samples(r, c, data,
                                                                                         log=lambda s: None))
        wrapped, opt, update = hand(against, copy.deepcopy(model))

        def theirs() -> None:
            for s in range(steps):
                update(wrapped, opt, data, s, rank, world)

        for name in SIDES[against]:
            med, best, a, b = interleaved_ratios(sides[name], theirs, runs=runs, reps=1, warmup=1)
            if rank == 0:
                label = "sharding='parameters'" if name == "parameters" else f"engine={name!r}"
                print(f"{label:22} {a / steps * 1e3:7.2f} ms/update vs hand {against.upper()} loop "
                      f"{b / steps * 1e3:7.2f} ms/update   ratio median {med:.3f}, best {best:.3f}", flush=True)
        if rank == 0:
            print(f"torch {torch.__version__}, {world} gloo processes x 1 thread, {steps} updates per run, {runs} runs, "
                  f"{sum(p.numel() for p in model.parameters()):,} parameters")
    finally:
        dist.destroy_process_group()


def kib(key: str) -> int:
    """A line of ``/proc/self/status`` (VmRSS: resident now; VmHWM: its high-water mark), in KiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def run_side(side: str, model, data: list, steps: int, rank: int, world: int) -> None:
    if side.startswith("hand "):
        wrapped, opt, update = hand(side[5:], model)
        for s in range(steps):
            update(wrapped, opt, data, s, rank, world)
    else:
        lt.train_samples(lt.Runner.from_module(model, gpt_loss), side_config(side, steps), data, log=lambda s: None)


def peak_worker(rank: int, world: int, init: str, steps: int, side: str, out: str, warm: bool) -> None:
    """One side alone in fresh processes: the peak resident memory a run adds to a rank
    (Linux's high-water mark, reset just before the run, minus the resident set then: the
    model and data built; ``warm``: after a 2-update run of the side on a copy)."""
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        data, model = work()
        if warm:
            run_side(side, copy.deepcopy(model), data, 2, rank, world)
            gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark starts again from the resident set
        before = kib("VmRSS")
        run_side(side, model, data, steps, rank, world)
        with open(os.path.join(out, f"{side}.{rank}"), "w") as f:
            f.write(str(kib("VmHWM") - before))
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--memory", action="store_true", help="peak memory per rank instead: each side alone")
    ap.add_argument("--warm", action="store_true", help="--memory after a first run (what a run holds)")
    ap.add_argument("--against", choices=sorted(SIDES), default="ddp", help="the hand loop: DDP or FSDP2")
    ap.add_argument("--world", type=int, default=2, help="processes (each 1 thread; ITEMS items per update)")
    args = ap.parse_args()
    w = args.world
    with tempfile.TemporaryDirectory() as tmp:
        if not args.memory:
            mp.spawn(worker, args=(w, os.path.join(tmp, "init"), args.steps, args.runs, args.against), nprocs=w,
                     join=True)
            return
        for side in (f"hand {args.against}", *SIDES[args.against]):
            init = os.path.join(tmp, "init-" + side.replace(" ", "-"))  # a rendezvous file of its own per side
            mp.spawn(peak_worker, args=(w, init, args.steps, side, tmp, args.warm), nprocs=w, join=True)
            added = [int(open(os.path.join(tmp, f"{side}.{r}")).read()) / 1024 for r in range(w)]
            name = (f"hand {side[5:].upper()} loop" if side.startswith("hand ") else
                    "sharding='parameters'" if side == "parameters" else f"engine={side!r}")
            print(f"{name:20} peak resident memory a{' warm' if args.warm else ''} run adds, per rank: "
                  f"{', '.join(f'{m:.1f} MiB' for m in added)}", flush=True)


if __name__ == "__main__":
    main()
