"""The TorchLean quickstart data and model (spec §11)."""

from __future__ import annotations

import torch
from torch import nn

HELDOUT = (0.25, -0.75)  # the held-out input; its target is 0.2


def target(x: torch.Tensor) -> torch.Tensor:
    """``0.8*relu(x1 + x2) - 0.4*relu(x2 - x1) + 0.2`` for one point ``x`` of shape (2,)."""
    return (0.8 * torch.relu(x[0] + x[1]) - 0.4 * torch.relu(x[1] - x[0]) + 0.2).reshape(1)


def grid(n: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """An ``n x n`` grid on [-1, 1]^2, row-major with the first coordinate outer."""
    pts = [-1.0 + (i / (n - 1)) * 2.0 for i in range(n)]
    return [(x, target(x)) for a in pts for b in pts for x in [torch.tensor([a, b])]]


def mlp(seed: int = 0) -> nn.Sequential:
    """The 2-8-1 ReLU MLP, initialised from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1))
