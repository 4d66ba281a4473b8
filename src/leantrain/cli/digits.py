"""The bundled digits data set and the model presets of ``leantrain train``.

The data are scikit-learn's ``load_digits`` (the UCI optical digits test set:
1,797 greyscale 8x8 images, values 0-16, ten classes; CC BY 4.0), shipped in the
package as ``datasets/digits.safetensors`` so nothing is downloaded. The
train/test split is fixed: a seeded permutation, 360 test images.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file
from torch import nn

from ..data import lcg_permutation

DATA = Path(__file__).parent / "datasets" / "digits.safetensors"
TEST_SIZE, SPLIT_SEED = 360, 2024

Sample = tuple[torch.Tensor, torch.Tensor]


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """Images as float32 in [0, 1], shape (1797, 1, 8, 8), and int64 labels (1797,)."""
    raw = load_file(str(DATA))
    return raw["images"].to(torch.float32).div_(16.0).unsqueeze(1), raw["labels"]


def digits_split() -> tuple[list[Sample], list[Sample]]:
    """(train, test) lists of single-image samples ``(x (1, 8, 8), y ())``; fixed split."""
    images, labels = load_digits()
    _, perm = lcg_permutation(SPLIT_SEED, len(labels))
    samples = [(images[i], labels[i]) for i in perm]
    return samples[TEST_SIZE:], samples[:TEST_SIZE]


class SharedMLP(nn.Module):
    """64-128-128-128-10 MLP whose two middle layers share one weight matrix (a tie)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 128)
        self.mid1 = nn.Linear(128, 128)
        self.mid2 = nn.Linear(128, 128)
        self.mid2.weight = self.mid1.weight  # tied: one storage at two slots
        self.out = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., 1, 8, 8)
        h = torch.relu(self.inp(x.flatten(-3)))
        h = torch.relu(self.mid1(h))
        h = torch.relu(self.mid2(h))
        return self.out(h)  # (..., 10) logits


class SmallCNN(nn.Module):
    """Two 3x3 conv blocks with BatchNorm (running statistics are buffers), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.head = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 1, 8, 8)
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.max_pool2d(torch.relu(self.bn2(self.conv2(h))), 2)  # (B, 32, 4, 4)
        return self.head(h.flatten(1))


def _text_gpt() -> nn.Module:
    from .text import TextGPT

    return TextGPT()


PRESETS: dict[str, Callable[[], nn.Module]] = {"digits-mlp": SharedMLP, "digits-cnn": SmallCNN, "text-gpt": _text_gpt}


def stack_minibatches(batch_size: int) -> Callable[[list[Sample]], list[Sample]]:
    """Collate ``B*K`` single samples into ``K`` stacked minibatches of ``B`` (the last
    may be shorter): one vectorised forward per minibatch, gradients accumulated over K."""

    def collate(samples: list[Sample]) -> list[Sample]:
        out = []
        for i in range(0, len(samples), batch_size):
            chunk = samples[i : i + batch_size]
            out.append((torch.stack([x for x, _ in chunk]), torch.stack([y for _, y in chunk])))
        return out

    return collate
