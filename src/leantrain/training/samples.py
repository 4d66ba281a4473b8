"""What a sample is (an ``(x, y)`` pair of tensors) and the losses known by name."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..errors import ConfigError

Sample = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

LOSSES: dict[str, LossFn] = {"mse": F.mse_loss, "cross_entropy": F.cross_entropy}


def check_sample(op: str, sample: object, index: int = 0) -> Sample:
    """A sample is an ``(x, y)`` pair of tensors (either may hold a minibatch)."""
    if (
        not isinstance(sample, (tuple, list))
        or len(sample) != 2
        or not all(isinstance(t, torch.Tensor) for t in sample)
    ):
        got = type(sample).__name__
        if isinstance(sample, (tuple, list)):
            got += f" of {len(sample)}: " + ", ".join(type(t).__name__ for t in sample)
        raise ConfigError(f"{op}: item {index}: expected an (x, y) pair of tensors, got {got}")
    return sample[0], sample[1]
