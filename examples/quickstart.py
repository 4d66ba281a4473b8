"""The TorchLean quickstart (spec §11): a 2-8-1 MLP fit to a 5x5 grid with Adam 0.03.

Run: .venv/bin/python examples/quickstart.py [--steps 200] [--seed 0]
"""

from __future__ import annotations

import argparse

import torch

import leantrain as lt
from leantrain import optim
from leantrain.cli.quickstart import HELDOUT, grid, mlp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    runner = lt.Runner.from_module(mlp(args.seed), "mse")
    data = grid()  # 25 samples: x (2,), y (1,)
    print(f"dataset size = {len(data)}")
    report = lt.train_samples(
        runner, lt.TrainConfig(steps=args.steps, optimizer=optim.adam(0.03), log_every=25), data
    )
    print(f"mean_loss(before training) = {report.before:.6f}")
    print(f"mean_loss(after training) = {report.after:.6f}")
    pred = runner.eval().predict(torch.tensor(HELDOUT))
    print(f"trained(heldout) = [{pred.item():.6f}]  (target 0.200000)")


if __name__ == "__main__":
    main()
