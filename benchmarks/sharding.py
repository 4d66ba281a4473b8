"""Sharding against unsharded data parallel and DDP + ZeroRedundancyOptimizer (gloo, CPU).

A model whose Adam state dominates: an MLP of 4 square layers, 1024 wide by default
(4.2M parameters, 33.6 MB of AdamW state unsharded; ``--width 4096``: 67M and 537 MB),
tiny batches (2 items of 4 samples per update), so the update and the communication
are what is timed. In 2 processes, one thread each,
the contenders run interleaved, round after round (the order rotating):

* leantrain data parallel, unsharded (``train_samples``, default reduction);
* leantrain ``sharding="optimizer"`` (ZeRO-1), ``sharding="gradients"`` (ZeRO-2), the latter
  with ``exact_reduction`` too, and ``sharding="parameters"`` (ZeRO-3: one-process bits);
* ``DistributedDataParallel`` + ``ZeroRedundancyOptimizer(AdamW)``: torch's ZeRO-1;
* ``DistributedDataParallel`` + ``AdamW(fused=True)``: the fastest unsharded loop;
* FSDP2: ``fully_shard`` on every Linear and the root, ``AdamW`` (its default foreach
  implementation) over the sharded parameters: torch's ZeRO-3.

Each contender's first update (allocation, FSDP2's lazy setup) is left out of the times.
``--memory 1 2 4 8``: only the memory table, the largest rank's added peak in units of P
(the parameter bytes) at each world size, with at least one item per rank.

Per update: best and median over the rounds of each round's median step time (the
first step of a round, which allocates, left out), and the ratio to DDP + ZeRO. Per
rank: the bytes of optimizer state each contender holds (leantrain: its records'
tensors; torch: its optimizer's state tensors), and the peak resident memory one round
adds to a fresh pair of processes (each contender alone: Linux's high-water mark,
reset through ``/proc/self/clear_refs`` once the process group is up, minus the
resident memory then; it counts the model, gradients, state and communication buffers).
Those processes run with ``MALLOC_MMAP_THRESHOLD_=65536``: glibc then maps every
tensor-sized block and returns it when freed, so resident memory follows what is alive
(by default its threshold grows with the blocks freed and later blocks come from a heap
that is not given back, which adds allocator history to every figure).

``--model gpt``: a tied-head GPT of 10 blocks, 512 wide (35.7M parameters; FSDP2 wraps each
block, as its examples do), items of 2 sequences of 32 tokens.

Run: .venv/bin/python benchmarks/sharding.py [--rounds 7 --steps 6 --width 1024] [--model gpt] [--memory 1 2 4 8]
[--only TEXT...] (the contenders whose names contain one of the texts) [--times-only] (no memory table)

It ends with a line per leantrain contender, ``... ratio best X, median Y`` against FSDP2
(where it ran; otherwise DDP + ZeRO): ``../shared/tools/ab_bench.py`` A/Bs those, e.g.
``python ../shared/tools/ab_bench.py BASE --rounds 3 --bench benchmarks/sharding.py -- --model gpt
--only sharding=parameters FSDP2 --times-only``.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import leantrain as lt
from leantrain import optim

WIDTH, LAYERS, BATCH = int(os.environ.get("LEANTRAIN_BENCH_WIDTH", 1024)), 4, 4
ITEMS = int(os.environ.get("LEANTRAIN_BENCH_ITEMS", 2))
LR, WD = 1e-3, 0.01
# --model gpt: a tied-head GPT of GPT_LAYERS blocks, WIDTH wide (512: 35.7M parameters), items
# of GPT_BATCH sequences of GPT_T tokens
MODEL = os.environ.get("LEANTRAIN_BENCH_MODEL", "mlp")
VOCAB, GPT_LAYERS, HEADS, GPT_T, GPT_BATCH = 8192, 10, 8, 32, 2


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, HEADS, d // HEADS).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(d, dim=2))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(GPT_T, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(GPT_LAYERS)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def model() -> nn.Module:
    torch.manual_seed(0)
    if MODEL == "gpt":
        return GPT(WIDTH)
    return nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if MODEL == "gpt":
        return nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))
    return nn.functional.mse_loss(out, y)


def data():
    g = torch.Generator().manual_seed(1)
    if MODEL == "gpt":
        return [(torch.randint(0, VOCAB, (GPT_BATCH, GPT_T), generator=g),
                 torch.randint(0, VOCAB, (GPT_BATCH, GPT_T), generator=g)) for _ in range(ITEMS)]
    return [(torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)) for _ in range(ITEMS)]


def described(width: int) -> str:
    params = sum(p.numel() for p in model().parameters())
    if MODEL == "gpt":
        return (f"GPT {GPT_LAYERS} blocks x {width} wide, tied head, vocabulary {VOCAB} ({params / 1e6:.1f}M "
                f"parameters), {ITEMS} items of {GPT_BATCH} x {GPT_T} tokens per update")
    return f"MLP {LAYERS} x {width}x{width} ({params / 1e6:.1f}M parameters), {ITEMS} items of {BATCH} per update"


def leantrain_round(sharding, steps: int, exact: bool = False, units=None):
    runner = lt.Runner.from_module(model(), loss_fn)
    cfg = lt.TrainConfig(steps=steps, batch_size=ITEMS, optimizer=optim.adamw(LR, WD), log_every=0,
                         measure_loss=False, replica_check=False, sharding=sharding, exact_reduction=exact,
                         shard_units=units)
    marks, held = [], {}

    def callback(event):
        marks.append(time.perf_counter())
        held["bytes"] = sum(t.numel() * t.element_size() for r in event.state.records().values()
                            for t in r.tensors().values())

    start = time.perf_counter()
    lt.train_samples(runner, cfg, data(), log=None, callback=callback)
    times = [b - a for a, b in zip([start] + marks, marks)][1:]
    return statistics.median(times), held["bytes"]


def timed_updates(opt, steps: int, item) -> list:
    """Each update's seconds: this rank's share of the items (``item(j, last, x, y)``
    differentiates one), then the optimizer step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = data()[rank::world]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for j, (x, y) in enumerate(mine):
            item(j, j == len(mine) - 1, x, y)
        opt.step()
        times.append(time.perf_counter() - start)
    return times


def fsdp_round(steps: int):
    """FSDP2: every Linear (the GPT: every block) its own ``fully_shard`` unit, then the
    root; AdamW over the sharded parameters (torch's parameter sharding, ZeRO-3)."""
    from torch.distributed.fsdp import fully_shard

    net = model()
    for m in (net.blocks if MODEL == "gpt" else net):
        if isinstance(m, (nn.Linear, Block)):
            fully_shard(m)
    fully_shard(net)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD)

    def item(j: int, last: bool, x, y) -> None:
        net.set_requires_gradient_sync(last)
        (loss_fn(net(x), y) * (1.0 / ITEMS)).backward()

    times = timed_updates(opt, steps, item)
    held = sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
               for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    return statistics.median(times[1:]), held


def ddp_round(zero: bool, steps: int):
    net = DDP(model())
    if zero:
        opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, weight_decay=WD)
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD, fused=True)

    def item(j: int, last: bool, x, y) -> None:
        with net.no_sync() if not last else torch.enable_grad():
            (loss_fn(net(x), y) * (1.0 / ITEMS)).backward()

    times = timed_updates(opt, steps, item)
    state = opt.optim.state if zero else opt.state
    held = sum(t.numel() * t.element_size() for s in state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)
    return statistics.median(times[1:]), held


CONTENDERS = {
    "leantrain unsharded": lambda steps: leantrain_round(None, steps),
    "leantrain sharding=optimizer": lambda steps: leantrain_round("optimizer", steps),
    "leantrain sharding=gradients": lambda steps: leantrain_round("gradients", steps),
    "leantrain gradients, exact": lambda steps: leantrain_round("gradients", steps, exact=True),
    "leantrain sharding=parameters": lambda steps: leantrain_round("parameters", steps),  # the GPT: block units
    "leantrain parameters, module units": lambda steps: leantrain_round("parameters", steps, units=()),
    "DDP + ZeroRedundancyOptimizer": lambda steps: ddp_round(True, steps),
    "DDP + AdamW(fused)": lambda steps: ddp_round(False, steps),
    "FSDP2 (fully_shard) + AdamW": fsdp_round,
}


if os.environ.get("LEANTRAIN_BENCH_ONLY"):
    CONTENDERS = {n: CONTENDERS[n] for n in os.environ["LEANTRAIN_BENCH_ONLY"].split("\n")}


def worker(rank: int, world: int, init: str, rounds: int, steps: int, q) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    names = list(CONTENDERS)
    times = {n: [] for n in names}
    held = {}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for n in order:
            dist.barrier()
            t, b = CONTENDERS[n](steps)
            times[n].append(t)
            held[n] = b
    everyone = [None] * world
    dist.all_gather_object(everyone, held)
    if rank == 0:
        q.put((times, everyone))
    dist.destroy_process_group()


def _status(field: str) -> int:
    """A ``/proc/self/status`` figure in KiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


def peak_worker(rank: int, world: int, init: str, name: str, steps: int, q) -> None:
    """One contender alone in fresh processes: the peak resident memory its round adds."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    dist.barrier()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the high-water mark to the resident memory now
    base = _status("VmRSS")
    print(f"[peak of {name!r} on {world} ranks: rank {rank}]", file=sys.stderr, flush=True)  # names a crash
    CONTENDERS[name](steps)
    added = _status("VmHWM") - base
    everyone = [None] * world
    dist.all_gather_object(everyone, added)
    if rank == 0:
        q.put(everyone)
    dist.destroy_process_group()


def peaks(steps: int, world: int = 2) -> dict:
    """Each contender's added peak resident memory per rank (KiB), in ``world`` fresh
    processes."""
    ctx = mp.get_context("spawn")
    out = {}
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by the spawned processes' allocator at start
    for name in CONTENDERS:
        q = ctx.SimpleQueue()
        init = os.path.join(tempfile.mkdtemp(), "init")
        try:
            mp.spawn(peak_worker, args=(world, init, name, steps, q), nprocs=world, join=True)
        except mp.ProcessExitedException as e:  # seen: FSDP2's processes aborting as they exit, at 67M
            print(f"[{name!r} on {world} ranks: {e}; its peak is {'kept' if not q.empty() else 'lost'}]",
                  file=sys.stderr, flush=True)
        out[name] = q.get() if not q.empty() else [float("nan")] * world
    return out


def memory_table(worlds: list, steps: int, width: int) -> None:
    """Per-rank peak (the largest rank's) in units of P, the parameter bytes, per world size."""
    p_bytes = 4 * LAYERS * (width * width + width)
    table = {w: peaks(steps, w) for w in worlds}
    print(f"MLP {LAYERS} x {width}x{width}, AdamW, {ITEMS} items per update (one per rank at W={max(worlds)}), "
          f"{steps} updates: the peak resident memory a run adds, largest rank, in P = {p_bytes / 2**20:.1f} MiB")
    print(f"{'contender':32s} " + " ".join(f"{'W=' + str(w):>7s}" for w in worlds))
    for n in CONTENDERS:
        print(f"{n:32s} " + " ".join(f"{max(table[w][n]) * 1024 / p_bytes:7.2f}" for w in worlds))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--width", type=int, default=WIDTH, help="the layers' width (4 layers; the GPT: 512 by default)")
    ap.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    ap.add_argument("--world", type=int, default=2, help="processes timed (each one thread)")
    ap.add_argument("--memory", type=int, nargs="*", metavar="W",
                    help="only the peak-memory table, at these world sizes (e.g. --memory 1 2 4 8)")
    ap.add_argument("--times-only", action="store_true", help="no peak-memory processes after the timing")
    ap.add_argument("--only", nargs="*", metavar="TEXT",
                    help="only the contenders whose names contain one of these (e.g. --only parameters FSDP2)")
    args = ap.parse_args()
    if args.only:
        for name in [n for n in CONTENDERS if not any(t in n for t in args.only)]:
            del CONTENDERS[name]
        os.environ["LEANTRAIN_BENCH_ONLY"] = "\n".join(CONTENDERS)  # the spawned processes run the same ones
    global MODEL
    MODEL = os.environ["LEANTRAIN_BENCH_MODEL"] = args.model  # the spawned processes build the same model
    if args.model == "gpt" and args.width == WIDTH:
        args.width = 512
    os.environ["LEANTRAIN_BENCH_WIDTH"] = str(args.width)
    globals()["WIDTH"] = args.width
    if args.memory:
        global ITEMS
        ITEMS = max(ITEMS, max(args.memory))  # every rank has an item
        os.environ["LEANTRAIN_BENCH_ITEMS"] = str(ITEMS)
        return memory_table(args.memory, args.steps, args.width)
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    init = os.path.join(tempfile.mkdtemp(), "init")
    if args.world > ITEMS:
        ITEMS = args.world  # every rank has an item
        os.environ["LEANTRAIN_BENCH_ITEMS"] = str(ITEMS)
    try:
        mp.spawn(worker, args=(args.world, init, args.rounds, args.steps, q), nprocs=args.world, join=True)
    except mp.ProcessExitedException as e:  # seen: a process aborting as it exits (FSDP2's), after its results
        if q.empty():
            raise
        print(f"[timing processes: {e}; the times were sent before]", file=sys.stderr, flush=True)
    times, held = q.get()
    peak = {n: [float("nan")] * args.world for n in times} if args.times_only else peaks(args.steps, args.world)
    params = sum(p.numel() for p in model().parameters())
    base = "DDP + ZeroRedundancyOptimizer" if "DDP + ZeroRedundancyOptimizer" in times else next(iter(times))
    print(f"{described(args.width)}, AdamW, {args.world} processes x 1 thread, {args.rounds} rounds of {args.steps} updates, "
          f"{os.cpu_count()} cores")
    print(f"{'contender':32s} {'best ms':>8s} {'median ms':>10s} {'vs ZeRO best':>13s} {'median':>7s} "
          f"{'state MB/rank (rank 0, 1)':>27s} {'peak MiB/rank':>14s}")
    for n, ts in times.items():
        ratio_best = min(ts) / min(times[base])
        ratio_med = statistics.median(a / b for a, b in zip(ts, times[base]))
        mb = ", ".join(f"{h[n] / 1e6:.1f}" for h in held)
        rss = ", ".join(f"{k / 1024:.1f}" for k in peak[n])
        print(f"{n:32s} {min(ts) * 1e3:8.1f} {statistics.median(ts) * 1e3:10.1f} {ratio_best:13.2f} "
              f"{ratio_med:7.2f} {mb:>27s} {rss:>14s}")
    print(f"unsharded AdamW state: {2 * 4 * params / 1e6:.1f} MB per rank")
    # one line per leantrain contender against torch's nearest (FSDP2 where it ran): ab_bench's form
    ref = "FSDP2 (fully_shard) + AdamW" if "FSDP2 (fully_shard) + AdamW" in times else base
    for n, ts in times.items():
        if n.startswith("leantrain"):
            ratio_med = statistics.median(a / b for a, b in zip(ts, times[ref]))
            print(f"{n} {statistics.median(ts) * 1e3:.1f} ms vs {ref}: ratio best {min(ts) / min(times[ref]):.2f}, "
                  f"median {ratio_med:.2f}")


if __name__ == "__main__":
    sys.exit(main())
