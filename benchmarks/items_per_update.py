"""Several items per update in one process (#55 item 3): ``train_samples`` with
``batch_size=k`` items of 8 rows on a 1e6-parameter MLP (512-1024-512, AdamW) against the
hand-written loop that accumulates each item's ``loss.backward()`` into ``.grad``, scales
by 1/k and steps ``AdamW(fused=True)`` (the same bits as leantrain's sum times 1/k), at k
= 1, 4 and 16. Same process, interleaved; best of N (each side's fastest run) and the
median of the per-run ratios (< 1: leantrain faster); beside the time, the minor page
faults per update of each side (``getrusage``: fresh memory the allocator maps).

Run: .venv/bin/python benchmarks/items_per_update.py [--runs 11] [--threads 1] [--updates 20]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved_ratios  # noqa: E402

import leantrain as lt  # noqa: E402
from leantrain import optim  # noqa: E402


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=11)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--updates", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} thread(s), MLP 512-1024-512 (1.05M parameters), AdamW, "
          f"{a.updates} updates per run")
    for k in (1, 4, 16):
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(8, 512, generator=g), torch.randn(8, 512, generator=g)) for _ in range(k)]
        ours_model, hand_model = mlp(), mlp()
        runner = lt.Runner.from_module(ours_model, "mse")
        cfg = lt.TrainConfig(steps=a.updates, batch_size=k, optimizer=optim.adamw(1e-4), log_every=0,
                             measure_loss=False)
        opt = torch.optim.AdamW(hand_model.parameters(), lr=1e-4, fused=True)
        counted = {"ours": 0, "hand": 0}

        def ours():
            f = faults()
            lt.train_samples(runner, cfg, data, log=None)
            counted["ours"] += faults() - f

        def hand():
            f = faults()
            for _ in range(a.updates):
                opt.zero_grad(set_to_none=True)
                for x, y in data:
                    nn.functional.mse_loss(hand_model(x), y).backward()
                if k > 1:
                    for p in hand_model.parameters():
                        p.grad.mul_(1.0 / k)
                opt.step()
            counted["hand"] += faults() - f

        median, best, t_ours, t_hand = interleaved_ratios(ours, hand, runs=a.runs)
        calls = a.runs + 2  # the warm-up runs count too
        per = {s: counted[s] / (calls * a.updates) for s in counted}
        print(f"items {k:>2} per update   {t_ours / a.updates * 1e3:.2f} ms vs {t_hand / a.updates * 1e3:.2f} ms "
              f"per update; page faults per update {per['ours']:.0f} vs {per['hand']:.0f}; "
              f"ratio best {best:.3f}, median {median:.3f}")


if __name__ == "__main__":
    main()
