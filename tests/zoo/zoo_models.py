"""The model zoo: small versions of the models people train, each with its data and loss.

Every entry builds a fresh model from a seed and yields samples ``(x, y)`` whose
``x`` is a minibatch (the way a collated DataLoader batch reaches leantrain). The
zoo covers what small MLPs do not: ties with buffers, BatchNorm, dropout, a module
called twice, recurrent weights, padding embeddings, parametrizations, frozen parts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, BLOCK = 11, 6


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)  # a key bias has zero gradient: pure noise
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape  # (B, T, d)
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))  # (B, h, T, T)
        att = att.masked_fill(~mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (self.drop(att) @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """Two blocks, ``lm_head`` tied to ``tok_emb``, a causal mask buffer, dropout."""

    def __init__(self, persistent_mask: bool = False, d: int = 12, heads: int = 2) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, d)
        self.pos_emb = nn.Parameter(torch.randn(BLOCK, d) * 0.1)
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.ModuleList([Block(d, heads, 0.1) for _ in range(2)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # the tie
        mask = torch.tril(torch.ones(BLOCK, BLOCK, dtype=torch.bool))
        self.register_buffer("mask", mask, persistent=persistent_mask)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, VOCAB)
        x = self.drop(self.tok_emb(idx) + self.pos_emb[: idx.shape[1]])
        for block in self.blocks:
            x = block(x, self.mask)
        return self.lm_head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class TorchEncoder(nn.Module):
    """torch's own transformer layers: nn.TransformerEncoderLayer (its self-attention reads
    out_proj.weight without calling out_proj) and a bare nn.MultiheadAttention."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 16)
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.enc(self.inp(x))
        return self.head(self.mha(h, h, h, need_weights=False)[0].mean(1))


class ConvNet(nn.Module):
    """Conv, BatchNorm2d, ReLU, Dropout, linear head: (B, 1, 6, 6) -> (B, 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, bias=False)  # BatchNorm follows: a bias would be noise
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(F.relu(self.bn(self.conv(x)))).flatten(1))


class SharedTwice(nn.Module):
    """One submodule called twice in forward: one slot, autograd sums both uses."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 5)
        self.block = nn.Linear(5, 5)
        self.out = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.block(torch.tanh(self.block(h))))
        return self.out(h)


class LSTMClassifier(nn.Module):
    """(B, T, 3) -> (B, 2) from the last hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 5, batch_first=True)
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


class PaddedEmbedding(nn.Module):
    """Embedding with ``padding_idx`` (its row gets no gradient) and LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(9, 6, padding_idx=0)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, L) -> (B, 2)
        return self.head(self.norm(self.emb(idx)).mean(dim=1))


class WeightNormNet(nn.Module):
    """A Linear under ``parametrizations.weight_norm`` (slots ``original0/1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.utils.parametrizations.weight_norm(nn.Linear(4, 6))
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)))


class FrozenBackbone(nn.Module):
    """A frozen backbone holding BatchNorm (its statistics still advance), a trained head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.head = nn.Linear(8, 3)
        self.backbone.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


class ConstantBuffer(nn.Module):
    """The only buffer is a persistent constant (a feature scale), read every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor([0.5, 2.0, 1.0, -1.0]))
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x * self.scale)


@dataclass(frozen=True)
class Entry:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator, int], torch.Tensor]  # (generator, rows) -> x
    targets: Callable[[torch.Generator, torch.Tensor], torch.Tensor]  # (generator, x) -> y
    loss: object  # a leantrain loss name or callable
    tied: bool = False
    writes_buffers: bool = False

    def model(self, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return self.build()

    def samples(self, n: int, rows: int = 3, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(n):
            x = self.inputs(g, rows)
            out.append((x, self.targets(g, x)))
        return out

    def loss_fn(self):
        return {"mse": F.mse_loss, "cross_entropy": F.cross_entropy}.get(self.loss, self.loss)


def _tokens(g, rows):
    return torch.randint(0, VOCAB, (rows, BLOCK), generator=g)


def _next_tokens(g, x):
    return torch.roll(x, -1, dims=1)  # predict the next character (wrapping)


def _classes(k):
    return lambda g, x: torch.randint(0, k, (x.shape[0],), generator=g)


def _reals(k):
    return lambda g, x: torch.randn(x.shape[0], k, generator=g)


def _padded(g, rows):
    idx = torch.randint(1, 9, (rows, 5), generator=g)
    idx[:, 3:] = 0  # two pads per row
    return idx


ZOO = [
    Entry("gpt", lambda: CharGPT(False), _tokens, _next_tokens, lm_loss, tied=True),
    Entry("gpt_persistent_mask", lambda: CharGPT(True), _tokens, _next_tokens, lm_loss, tied=True),
    Entry("cnn_batchnorm", ConvNet, lambda g, r: torch.randn(r, 1, 6, 6, generator=g), _classes(3),
          "cross_entropy", writes_buffers=True),
    Entry("shared_twice", SharedTwice, lambda g, r: torch.randn(r, 4, generator=g), _reals(2), "mse"),
    Entry("lstm", LSTMClassifier, lambda g, r: torch.randn(r, 4, 3, generator=g), _classes(2),
          "cross_entropy"),
    Entry("padded_embedding", PaddedEmbedding, _padded, _reals(2), "mse"),
    Entry("weight_norm", WeightNormNet, lambda g, r: torch.randn(r, 4, generator=g), _reals(2), "mse"),
    Entry("frozen_backbone", FrozenBackbone, lambda g, r: torch.randn(r, 4, generator=g), _classes(3),
          "cross_entropy", writes_buffers=True),
    Entry("constant_buffer", ConstantBuffer, lambda g, r: torch.randn(r, 4, generator=g), _reals(3), "mse"),
]
BY_NAME = {e.name: e for e in ZOO}
# outside the zoo's table (which every zoo test runs): for the tests that name it
BY_NAME["torch_encoder"] = Entry("torch_encoder", TorchEncoder, lambda g, r: torch.randn(r, 5, 6, generator=g),
                                 _classes(3), "cross_entropy")
