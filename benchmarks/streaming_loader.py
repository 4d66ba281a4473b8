"""``train_loader`` streaming a torch DataLoader over a map-style dataset with a custom
collate (items made from their index: nothing stored), against the plain loop over the
same DataLoader (forward, backward, ``SGD(fused=True)``), with ``num_workers`` 0 and 2.

Prints, per worker count: the per-update time of one epoch (``measure_loss=False``)
against the plain loop, best of N and median of the per-run ratios (< 1: leantrain is
faster), in the same process, interleaved; the whole run with the defaults (the
``before``/``after`` passes included) against the plain loop; and the peak resident
memory of a child process training over N and 10N items (flat: the loader is never
read whole).

Run: .venv/bin/python benchmarks/streaming_loader.py [--runs N] [--items N]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved_ratios  # noqa: E402

import leantrain as lt  # noqa: E402
from leantrain import optim  # noqa: E402


class Synthetic(Dataset):
    """Item ``i`` made from ``i`` alone (a file read would do the same): 256 features."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(256, generator=g)
        return x, x[:8].sum(0, keepdim=True)


def collate(items):
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))


def loader(n: int, workers: int) -> DataLoader:
    return DataLoader(Synthetic(n), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0),
                      collate_fn=collate, num_workers=workers, persistent_workers=False)


def plain_epoch(model, opt, data) -> None:
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def peak_rss_child(n: int) -> None:
    torch.set_num_threads(1)
    r = lt.Runner.from_module(mlp(), "mse")
    lt.train_loader(r, lt.LoaderTrainConfig(epochs=1, optimizer=optim.sgd(0.01), log_every=0, measure_loss=False),
                    loader(n, 0))
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=11)
    ap.add_argument("--items", type=int, default=4096)
    ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return peak_rss_child(args.child)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, {args.items} items of 256 features, batches of 64")
    for workers in (0, 2):
        torch.manual_seed(1)
        ours_model, ref_model = mlp(), mlp()
        r = lt.Runner.from_module(ours_model, "mse")
        cfg = lt.LoaderTrainConfig(epochs=1, optimizer=optim.sgd(0.01), log_every=0, measure_loss=False)
        full = lt.LoaderTrainConfig(epochs=1, optimizer=optim.sgd(0.01), log_every=0)
        opt = torch.optim.SGD(ref_model.parameters(), lr=0.01, fused=True)
        steps = -(-args.items // 64)

        med, best, t_ours, t_ref = interleaved_ratios(lambda: lt.train_loader(r, cfg, loader(args.items, workers)),
                                                      lambda: plain_epoch(ref_model, opt, loader(args.items, workers)),
                                                      runs=args.runs)
        print(f"num_workers={workers}: per update {1e3 * t_ours / steps:.3f} ms vs plain loop "
              f"{1e3 * t_ref / steps:.3f} ms   ratio best {best:.3f}, median {med:.3f}")
        med, best, t_ours, t_ref = interleaved_ratios(lambda: lt.train_loader(r, full, loader(args.items, workers)),
                                                      lambda: plain_epoch(ref_model, opt, loader(args.items, workers)),
                                                      runs=max(3, args.runs // 3))
        print(f"num_workers={workers}: whole run with the defaults (before/after passes) {t_ours:.3f} s vs "
              f"{t_ref:.3f} s   ratio best {best:.3f}, median {med:.3f}")
    rss = []
    for n in (args.items, 10 * args.items):
        out = subprocess.run([sys.executable, __file__, "--child", str(n)], capture_output=True, text=True, check=True)
        rss.append(int(out.stdout.split()[-1]))
    print(f"peak resident memory, one epoch: {args.items} items {rss[0] / 1024:.1f} MiB, "
          f"{10 * args.items} items {rss[1] / 1024:.1f} MiB ({100 * (rss[1] / rss[0] - 1):+.1f}%)")


if __name__ == "__main__":
    main()
