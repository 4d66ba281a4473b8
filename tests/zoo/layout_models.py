"""Zoo models for memory layouts and gradients autograd hands back in odd shapes.

Each holds what the second oracle found trained wrong: parameters that are views with
gaps or interleaved with each other (with guard elements around them that no parameter
owns), a transposed and a channels_last parameter used elementwise and through a
reshape, a stride-0 gradient (``w.sum(0)``) beside BatchNorm, a top-1 mixture of experts
whose idle experts get no gradient, an input-dependent branch and a parameter the
forward never uses, two parameters that receive one gradient tensor (``x * (a + b)``),
spectral_norm (a forward that reads the buffers it writes) and a sparse embedding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo_models import Entry


class Interleaved(nn.Module):
    """Parameters over shared bases: rows 0,2,4 and 1,3,5 of one (7, 4) base (row 6 a
    guard), column 0 of a (4, 3) base, and a gapped ``as_strided`` view of a vector."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = torch.randn(7, 4)  # plain attributes: the memory the views live in
        self.cols = torch.randn(4, 3)
        self.flat = torch.randn(20)
        self.even = nn.Parameter(self.rows[0:6:2])  # (3, 4) stride (8, 1)
        self.odd = nn.Parameter(self.rows[1:6:2])
        self.col = nn.Parameter(self.cols[:, 0])  # (4,) stride (3,)
        self.gapped = nn.Parameter(self.flat.as_strided((2, 3), (7, 2), 1))  # gaps between elements

    def guards(self) -> list[torch.Tensor]:
        """Copies of every element of the bases that no parameter owns."""
        owned = torch.zeros(20, dtype=torch.bool)
        owned[torch.tensor([1 + 7 * i + 2 * j for i in range(2) for j in range(3)])] = True
        return [self.rows[6].clone(), self.cols[:, 1:].clone(), self.flat[~owned].clone()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 4) -> (B, 2)
        h = torch.tanh(x @ self.even.t()) * torch.tanh(x @ self.odd.t())  # (B, 3)
        return h @ self.gapped.t() + (x * self.col).sum(-1, keepdim=True)


class Transposed(nn.Module):
    """A transposed parameter used elementwise, a channels_last conv weight used through
    a reshape and in a convolution: autograd's gradients come back in other layouts."""

    def __init__(self) -> None:
        super().__init__()
        self.wt = nn.Parameter(torch.randn(3, 4).t())  # (4, 3) stride (1, 4)
        self.kernel = nn.Parameter(torch.randn(2, 1, 2, 2).to(memory_format=torch.channels_last))
        self.head = nn.Linear(4 + 2 + 2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 4, 3) -> (B, 2)
        b = x.shape[0]
        h = (x * self.wt).sum(-1)  # (B, 4)
        k = x.reshape(b, 12)[:, :4] @ self.kernel.reshape(2, 4).t()  # (B, 2)
        c = F.conv2d(x.reshape(b, 1, 4, 3), self.kernel).mean((2, 3))  # (B, 2)
        return self.head(torch.tanh(torch.cat([h, k, c], 1)))


class ColumnSum(nn.Module):
    """``w.sum(0)`` as a bias after BatchNorm: a stride-0 gradient in a buffer-writing model."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 5, bias=False)  # BatchNorm follows: a bias would be noise
        self.bn = nn.BatchNorm1d(5)
        self.w = nn.Parameter(torch.randn(3, 5) * 0.1)
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.bn(self.lin(x)) + self.w.sum(0)))


class TopOneMoE(nn.Module):
    """Top-1 routing over four experts (the gate's bias keeps two of them idle), an
    input-dependent branch, and a parameter the forward never reads."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(d, 4)
        with torch.no_grad():
            self.gate.bias.copy_(torch.tensor([0.0, 0.0, -50.0, -50.0]))
        self.experts = nn.ModuleList([nn.Linear(d, d) for _ in range(4)])
        self.positive, self.negative = nn.Linear(d, 2), nn.Linear(d, 2)
        self.unused = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, d) -> (B, 2)
        probs = self.gate(x).softmax(-1)
        choice = probs.argmax(-1)
        out = x
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().flatten()
            if rows.numel():  # (a host read: routing is data-dependent)
                out = out.index_add(0, rows, expert(x[rows]) * probs[rows, e:e + 1])
        branch = self.positive if float(x.sum()) > 0 else self.negative
        return branch(torch.tanh(out))


class SharedGradient(nn.Module):
    """``x * (a + b)``: autograd hands ``a`` and ``b`` one gradient tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(4))
        self.b = nn.Parameter(torch.randn(4))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x * (self.a + self.b))


class SpectralNet(nn.Module):
    """A Linear under ``parametrizations.spectral_norm``: its forward runs a power
    iteration that reads and writes the buffers ``_u`` and ``_v``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.utils.parametrizations.spectral_norm(nn.Linear(4, 6))
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)))


class SparseEmbedding(nn.Module):
    """``nn.Embedding(sparse=True)`` (a sparse COO gradient) and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(9, 4, sparse=True)
        self.head = nn.Linear(4, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, L) -> (B, 2)
        return self.head(torch.tanh(self.emb(idx)).mean(1))


def _reals(k):
    return lambda g, x: torch.randn(x.shape[0], k, generator=g)


def _signed(g, rows):
    """Rows whose sum is positive or negative by turns, so both branches are taken."""
    x = torch.randn(rows, 4, generator=g)
    return x.abs() * (1 if torch.rand((), generator=g) < 0.5 else -1)


LAYOUT_ZOO = [
    Entry("interleaved_views", Interleaved, lambda g, r: torch.randn(r, 4, generator=g), _reals(2), "mse"),
    Entry("transposed_channels_last", Transposed, lambda g, r: torch.randn(r, 4, 3, generator=g), _reals(2), "mse"),
    Entry("column_sum_batchnorm", ColumnSum, lambda g, r: torch.randn(r, 4, generator=g), _reals(2), "mse",
          writes_buffers=True),
    Entry("top1_moe", TopOneMoE, _signed, _reals(2), "mse"),
    Entry("shared_gradient", SharedGradient, lambda g, r: torch.randn(r, 4, generator=g), _reals(2), "mse"),
    Entry("spectral_norm", SpectralNet, lambda g, r: torch.randn(r, 4, generator=g), _reals(2), "mse",
          writes_buffers=True),
]
LAYOUT_BY_NAME = {e.name: e for e in LAYOUT_ZOO}
SPARSE = Entry("sparse_embedding", SparseEmbedding, lambda g, r: torch.randint(0, 9, (r, 5), generator=g),
               _reals(2), "mse")
