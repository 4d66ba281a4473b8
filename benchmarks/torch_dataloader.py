"""``train_loader`` fed a ``torch.utils.data.DataLoader`` over a ``TensorDataset`` (tiny
MLP 32-64-64-1, 4096 rows, batches of 64, shuffled with a seeded generator, SGD) against
the hand-written loop over the same DataLoader, and against a loop that slices the
tensors itself (what the DataLoader's per-item fetch and stack costs). Same process,
interleaved; best of N and median of the per-run ratios (< 1: leantrain is faster).

Run: .venv/bin/python benchmarks/torch_dataloader.py [--runs N] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved_ratios  # noqa: E402

import leantrain as lt  # noqa: E402
from leantrain import optim  # noqa: E402


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=11)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4096, 32, generator=g), torch.randn(4096, 1, generator=g)
    torch.manual_seed(1)
    ours_model, ref_model, slice_model = mlp(), mlp(), mlp()
    ref_model.load_state_dict(ours_model.state_dict())
    slice_model.load_state_dict(ours_model.state_dict())
    runner = lt.Runner.from_module(ours_model, "mse")
    cfg = lt.LoaderTrainConfig(epochs=1, optimizer=optim.sgd(0.01), log_every=0, measure_loss=False)
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(2))
    topt = torch.optim.SGD(ref_model.parameters(), lr=0.01, fused=True)
    sopt = torch.optim.SGD(slice_model.parameters(), lr=0.01, fused=True)
    steps = len(loader)

    def ours():
        lt.train_loader(runner, cfg, loader, log=lambda s: None)

    def hand():
        for xb, yb in loader:
            topt.zero_grad()
            nn.functional.mse_loss(ref_model(xb), yb).backward()
            topt.step()

    perm_gen = torch.Generator().manual_seed(3)

    def sliced():
        perm = torch.randperm(len(x), generator=perm_gen)
        for k in range(0, len(x), 64):
            idx = perm[k:k + 64]
            sopt.zero_grad()
            nn.functional.mse_loss(slice_model(x[idx]), y[idx]).backward()
            sopt.step()

    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.runs} interleaved runs, {steps} steps per epoch")
    for label, fn in (("train_loader", ours), ("slicing loop", sliced)):
        med, best, a, b = interleaved_ratios(fn, hand, runs=args.runs)
        print(f"{label:<13} {a / steps * 1e6:7.1f} us/step vs hand loop over the DataLoader "
              f"{b / steps * 1e6:7.1f} us/step   ratio best {best:.3f}, median {med:.3f}")


if __name__ == "__main__":
    main()
