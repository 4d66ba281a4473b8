"""Small models and data shared by the tests."""

import torch
from torch import nn


def grid_samples(n=5):
    """The quickstart data (spec §11): a 5x5 grid on [-1, 1]^2, first coordinate outer."""
    pts = [-1.0 + (i / (n - 1)) * 2.0 for i in range(n)]
    out = []
    for a in pts:
        for b in pts:
            x = torch.tensor([a, b])
            y = 0.8 * torch.relu(x[0] + x[1]) - 0.4 * torch.relu(x[1] - x[0]) + 0.2
            out.append((x, y.reshape(1)))
    return out


def quickstart_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1))


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
