"""The TorchLean quickstart (spec §11): a 2-8-1 MLP fit to a 5x5 grid with Adam 0.03.

Run: .venv/bin/python examples/quickstart.py [--steps 200] [--seed 0]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import leantrain as lt
from leantrain import optim


def grid(n: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Row-major grid on [-1, 1]^2; target 0.8*relu(x1+x2) - 0.4*relu(x2-x1) + 0.2."""
    pts = [-1.0 + (i / (n - 1)) * 2.0 for i in range(n)]
    samples = []
    for a in pts:
        for b in pts:
            x = torch.tensor([a, b])
            y = 0.8 * torch.relu(x[0] + x[1]) - 0.4 * torch.relu(x[1] - x[0]) + 0.2
            samples.append((x, y.reshape(1)))
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1))
    runner = lt.Runner.from_module(model, "mse")
    data = grid()
    print(f"dataset size = {len(data)}")
    report = lt.train_samples(
        runner, lt.TrainConfig(steps=args.steps, optimizer=optim.adam(0.03), log_every=25), data
    )
    print(f"mean_loss(before training) = {report.before:.6f}")
    print(f"mean_loss(after training) = {report.after:.6f}")
    runner.eval()
    with torch.no_grad():
        pred = model(torch.tensor([0.25, -0.75]))
    print(f"trained(heldout) = [{pred.item():.6f}]  (target 0.200000)")


if __name__ == "__main__":
    main()
