"""A whole run with leantrain's defaults against the plain loop's whole run (#54): a
784-256-256-10 MLP, 2 epochs over 8,192 examples in batches of 128 (128 updates), AdamW,
cross-entropy, a log line with the loss each update on both sides, read from

* a ``torch.utils.data.DataLoader`` (``TensorDataset``, shuffled by a seeded generator);
* a ``leantrain.DataLoader`` with ``collate=torch.utils.data.default_collate`` (the plain
  loop reads the same loader's passes, ``epoch_batches()``).

leantrain: ``train_loader(runner, LoaderTrainConfig(epochs=2, optimizer=adamw(1e-3)), loader)``
and nothing else (its ``before``/``after`` losses over ``measure_batches`` batches, default
1); the plain loop: ``AdamW(fused=True)``, zero, forward, backward, step, ``loss.item()``.
Both sides' final parameters are compared bit for bit. ``--measure-batches N``/``all``/``off`` sets
leantrain's bound (``all``: the whole passes; ``off``: ``measure_loss=False``). Same process, alternated, best of N (each
side's fastest run) and the median of the per-run ratios (< 1: leantrain faster).

Run: .venv/bin/python benchmarks/whole_run.py [--runs 11] [--threads 2] [--measure-batches 1]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, default_collate

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved_ratios  # noqa: E402

import leantrain as lt  # noqa: E402
from leantrain import optim  # noqa: E402

LR = 1e-3


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def loaders(data: TensorDataset, kind: str):
    if kind == "torch":
        return DataLoader(data, batch_size=128, shuffle=True, generator=torch.Generator().manual_seed(3))
    return lt.DataLoader(data, batch_size=128, shuffle=True, seed=3, collate=default_collate)


def plain(data: TensorDataset, kind: str) -> list[torch.Tensor]:
    model, loader = mlp(), loaders(data, kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    step = 0
    for _ in range(2):
        if kind == "torch":
            batches = loader
        else:  # a leantrain.DataLoader's pass: each batch the collated (x, y), as one item
            loader, passed = loader.epoch_batches()
            batches = (b[0] for b in passed)
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            step += 1
            print(f"step {step}: loss {loss.item():.4f}")
    return [p.detach() for p in model.parameters()]


def ours(data: TensorDataset, kind: str, measure_batches) -> list[torch.Tensor]:
    model = mlp()
    runner = lt.Runner.from_module(model, "cross_entropy")
    extra = {"default": {}, "off": {"measure_loss": False}}.get(measure_batches, {"measure_batches": measure_batches})
    lt.train_loader(runner, lt.LoaderTrainConfig(epochs=2, optimizer=optim.adamw(LR), **extra), loaders(data, kind))
    return [p.detach() for p in model.parameters()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=11)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--measure-batches", default="default",
                    help="a number, 'all' (whole passes), 'off' (measure_loss=False) or 'default'")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    named = {"default": "default", "off": "off", "all": None}
    measure = named[a.measure_batches] if a.measure_batches in named else int(a.measure_batches)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(8192, 784, generator=g), torch.randint(0, 10, (8192,), generator=g))
    sink = io.StringIO()
    print(f"MLP 784-256-256-10, 2 epochs x 64 batches of 128, AdamW, {a.threads} threads, {a.runs} runs, "
          f"measure_batches={a.measure_batches}")
    for kind in ("torch", "leantrain"):
        with contextlib.redirect_stdout(sink):
            same = all(torch.equal(p, q) for p, q in zip(ours(data, kind, measure), plain(data, kind)))

        def run_ours():
            with contextlib.redirect_stdout(sink):
                ours(data, kind, measure)

        def run_plain():
            with contextlib.redirect_stdout(sink):
                plain(data, kind)

        t0 = time.perf_counter()
        median, best, t_ours, t_plain = interleaved_ratios(run_ours, run_plain, runs=a.runs)
        print(f"  {kind + ' DataLoader':<20} whole run leantrain/plain: best {best:.3f}, median {median:.3f} "
              f"({t_ours:.3f} s against {t_plain:.3f} s); parameters bit-equal: {same} "
              f"[{time.perf_counter() - t0:.0f} s]")
        sink.seek(0), sink.truncate()


if __name__ == "__main__":
    main()
