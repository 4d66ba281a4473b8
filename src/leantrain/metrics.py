"""Ready metrics for ``evaluate``: callables ``(output, target) -> tensor``.

A metric may return one value per example (averaged over every example of the
evaluation set, so a short last batch weighs by its size) or a 0-dim value per item
(averaged over items, like the loss)."""

from __future__ import annotations

import torch

from .samples import logits_of, target_of

__all__ = ["accuracy"]

IGNORE_INDEX = -100


def accuracy(output, target) -> torch.Tensor:
    """1.0 where the arg-max class of the logits (..., classes) equals the target, per
    example. Reads ``output.logits`` (or ``["logits"]``) from a model output and
    ``target["labels"]`` from a dict sample; targets of -100 are left out (torch's
    ``cross_entropy`` ignore index)."""
    logits, y = logits_of(output), target_of(target)
    hits = (logits.argmax(dim=-1) == y).to(torch.float32)
    return hits[y != IGNORE_INDEX]


# The ready metrics: library code, so a loop need not check the module again after them.
BUILTIN = (accuracy,)
