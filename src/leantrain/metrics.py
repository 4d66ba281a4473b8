"""Ready metrics for ``evaluate``: callables ``(output, target) -> tensor``.

A metric may return one value per example (averaged over every example of the
evaluation set, so a short last batch weighs by its size) or a 0-dim value per item
(averaged over items, like the loss)."""

from __future__ import annotations

import torch


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """1.0 where the arg-max class of ``output`` (..., classes) equals ``target``, per example."""
    return (output.argmax(dim=-1) == target).to(torch.float32)


# The ready metrics: library code, so a loop need not check the module again after them.
BUILTIN = (accuracy,)
