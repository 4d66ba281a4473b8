"""Small models and data shared by the tests."""

import torch
from torch import nn


def grid_samples(n=5):
    """The quickstart data (spec §11): a 5x5 grid on [-1, 1]^2, first coordinate outer."""
    from leantrain.cli.quickstart import grid

    return grid(n)


def quickstart_mlp(seed=0):
    from leantrain.cli.quickstart import mlp

    return mlp(seed)


class TiedNet(nn.Module):
    """An input projection tied to the output projection (transposed use), with BatchNorm."""

    def __init__(self, d=4, h=6, bn=True):
        super().__init__()
        self.inp = nn.Linear(d, h, bias=False)
        self.mid = nn.Linear(h, h)
        self.norm = nn.BatchNorm1d(h) if bn else nn.Identity()
        self.out = nn.Linear(h, h, bias=False)
        self.out.weight = self.mid.weight  # tied: the same Parameter at two slots

    def forward(self, x):
        return self.out(torch.tanh(self.norm(self.mid(torch.tanh(self.inp(x))))))


def regression_batches(n, batch, d=4, out=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d, generator=g), torch.randn(batch, out, generator=g)) for _ in range(n)]


def tiny_classifier(seed=0):
    """4 features to 3 classes, Linear-Tanh-Linear (the run-management tests' model)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def class_batches(n, seed, rows=5):
    """``n`` collated (x, y) batches of ``rows`` examples for ``tiny_classifier``."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 4, generator=g), torch.randint(0, 3, (rows,), generator=g)) for _ in range(n)]
