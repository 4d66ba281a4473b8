"""Measuring a loss over samples without training: the loops' ``before``/``after`` and
``Runner.mean_loss``."""

from __future__ import annotations

from typing import Iterable

import torch

from .binding import rng_preserved
from ...samples import LossSum, Sample, add_losses, check_sample


def mean_loss(runner, samples: Iterable[Sample]) -> float:
    """``(l1 + ... + ln) / n`` under the runner's current parameters and mode (``LossSum``
    items: the sum of totals over the sum of counts), reading ``samples`` (a list, or
    any iterable: one item at a time, nothing kept).

    Buffers and the random number generators are left as found (a measuring pass does
    not change what training draws next). No items give 0.0, upstream's rule. Reads one
    scalar back to the host (a device sync on CUDA), as asked.
    """
    total, n = loss_sums(runner, samples)
    if n == 0:
        return 0.0
    if isinstance(total, LossSum):
        return float((total.total / total.count).item())  # intentional sync: the caller asked
    return float((total / n).item())  # intentional sync: the caller asked


def loss_sums(runner, samples: Iterable[Sample]):
    """``(l1 + ... + ln, n)`` on the device (a ``LossSum`` of the items' totals and counts
    for such losses; ``(None, 0)`` without items), buffers and generators left as found."""
    total, n = None, 0
    with rng_preserved(runner.device), torch.no_grad():
        with runner.binding("Runner.mean_loss") as bound, bound.scratch_buffers():
            for s in samples:
                loss = runner.loss(check_sample("Runner.mean_loss", s, n))
                total = loss if total is None else add_losses(total, loss)
                n += 1
    return total, n
