"""Several items per update in one process (#55 item 3): ``train_samples`` with
``batch_size=k`` items of 8 rows on a 1e6-parameter MLP (512-1024-512, AdamW) against the
hand-written loop that accumulates each item's ``loss.backward()`` into ``.grad``, scales
by 1/k and steps ``AdamW(fused=True)`` (the same bits as leantrain's sum times 1/k), at k
= 1, 4 and 16 (< 1: leantrain faster); beside the time, the minor page faults per update
of each side (``getrusage``: fresh memory the allocator maps).

Page faults under glibc depend on where the heap's chunks fall (its start is randomised
per process, and ``posix_memalign``'s requests do not fit a freed chunk of the same size
exactly), for the hand loop as for leantrain, and two loops in one process disturb each
other's heap. So each side runs in fresh processes of its own, alternated (``--pairs``
pairs: leantrain's process, then the hand loop's, then the other way round); each process
times ``--runs`` runs after two warm-up runs. Reported per item count: ms per update and
page faults per update (medians over the processes), the median of the pairs' ratios of
median times, and the best of all runs' ratio. ``--tuned-malloc`` raises glibc's trim and
mmap thresholds (``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``), where neither side
faults and the time is the work alone.

Run: .venv/bin/python benchmarks/items_per_update.py [--pairs 5] [--runs 9] [--threads 1] [--updates 20]
[--tuned-malloc]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
from torch import nn


import leantrain as lt  # noqa: E402
from leantrain import optim  # noqa: E402


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def measure(a) -> dict:
    """One side's figures in this process, per item count: its runs' seconds and faults."""
    torch.set_num_threads(a.threads)
    out = {}
    for k in (1, 4, 16):
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(8, 512, generator=g), torch.randn(8, 512, generator=g)) for _ in range(k)]
        model = mlp()
        if a.child == "ours":
            runner = lt.Runner.from_module(model, "mse")
            cfg = lt.TrainConfig(steps=a.updates, batch_size=k, optimizer=optim.adamw(1e-4), log_every=0,
                                 measure_loss=False)

            def run():
                lt.train_samples(runner, cfg, data, log=None)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

            def run():
                for _ in range(a.updates):
                    opt.zero_grad(set_to_none=True)
                    for x, y in data:
                        nn.functional.mse_loss(model(x), y).backward()
                    if k > 1:
                        for p in model.parameters():
                            p.grad.mul_(1.0 / k)
                    opt.step()
        run()
        run()  # warm-up
        times, f = [], faults()
        for _ in range(a.runs):
            t = time.perf_counter()
            run()
            times.append((time.perf_counter() - t) / a.updates)
        out[k] = {"times": times, "faults": (faults() - f) / (a.runs * a.updates)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--updates", type=int, default=20)
    ap.add_argument("--tuned-malloc", action="store_true")
    ap.add_argument("--child", choices=("ours", "hand"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(a)))
        return
    env = dict(os.environ)
    if a.tuned_malloc:
        env.update(MALLOC_TRIM_THRESHOLD_=str(1 << 30), MALLOC_MMAP_THRESHOLD_=str(1 << 30))
    print(f"torch {torch.__version__}, {a.threads} thread(s), MLP 512-1024-512 (1.05M parameters), AdamW, "
          f"{a.updates} updates per run, {a.pairs} pairs of fresh processes x {a.runs} runs"
          f"{', glibc thresholds raised' if a.tuned_malloc else ''}")

    def side(name: str) -> dict:
        args = [sys.executable, __file__, "--child", name, "--runs", str(a.runs), "--threads", str(a.threads),
                "--updates", str(a.updates)]
        return json.loads(subprocess.run(args, env=env, check=True, capture_output=True, text=True).stdout)

    pairs = []
    for i in range(a.pairs):
        order = ("ours", "hand") if i % 2 == 0 else ("hand", "ours")
        got = {name: side(name) for name in order}
        pairs.append(got)
        print(f"pair {i}: " + "; ".join(
            f"{k} items {statistics.median(got['ours'][k]['times']) / statistics.median(got['hand'][k]['times']):.3f}"
            f" ({got['ours'][k]['faults']:.0f} vs {got['hand'][k]['faults']:.0f} faults)" for k in got["ours"]))
    for k in pairs[0]["ours"]:
        med = {s: [statistics.median(p[s][k]["times"]) for p in pairs] for s in ("ours", "hand")}
        ratio = statistics.median(o / h for o, h in zip(med["ours"], med["hand"]))
        best = min(min(p["ours"][k]["times"]) for p in pairs) / min(min(p["hand"][k]["times"]) for p in pairs)
        fl = {s: statistics.median(p[s][k]["faults"] for p in pairs) for s in ("ours", "hand")}
        print(f"items {k:>2} per update   {statistics.median(med['ours']) * 1e3:.2f} ms vs "
              f"{statistics.median(med['hand']) * 1e3:.2f} ms per update; page faults per update "
              f"{fl['ours']:.0f} vs {fl['hand']:.0f}; ratio best {best:.3f}, median of pairs {ratio:.3f}")


if __name__ == "__main__":
    main()
