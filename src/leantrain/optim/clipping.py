"""Gradient clipping on canonical gradients: each storage once, a tie with its summed
gradient, frozen slots never (they have none).

Norm clipping is ``torch.nn.utils.clip_grad_norm_``'s, operation for operation: the
per-tensor L2 norms by ``torch._foreach_norm`` per (device, dtype) group, their
``vector_norm`` as the total, the factor ``max_norm / (total + 1e-6)`` capped at 1,
and one ``_foreach_mul_`` per group. Value clipping clamps every element to
``[-value, value]`` (``clip_grad_value_``). Nothing is read to the host: the total
norm stays a device tensor, returned for the caller to log when it reads the loss.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from ..errors import ConfigError
from ..validate import is_number


def check_clip(op: str, max_norm: object, max_value: object) -> None:
    """Each bound is ``None`` or a finite number > 0; at most one of them is set."""
    for name, v in (("clip_grad_norm", max_norm), ("clip_grad_value", max_value)):
        if v is not None and not (is_number(v) and math.isfinite(v) and v > 0):
            raise ConfigError(f"{op}: {name} must be a finite number > 0 or None, got {v!r}")
    if max_norm is not None and max_value is not None:
        raise ConfigError(
            f"{op}: clip_grad_norm={max_norm!r} and clip_grad_value={max_value!r}: choose one way to clip"
        )


def _groups(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors by (device, dtype), groups in order of first appearance (torch's order)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def total_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all ``tensors`` viewed as one vector (a device tensor)."""
    norms: list[torch.Tensor] = []
    for group in _groups(tensors):
        norms.extend(torch._foreach_norm(group, 2.0))
    first = tensors[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), 2.0)


def clip_(sums: list, max_norm: Optional[float],
          max_value: Optional[float]) -> Optional[torch.Tensor]:
    """Clip the canonical gradients ``sums`` in place (``None`` entries, slots without a
    gradient, skipped). A sparse gradient is replaced by its coalesced form and clipped
    through its values (torch's ``clip_grad_norm_`` refuses sparse gradients). Returns
    the total norm before clipping when clipping by norm, else ``None``."""
    for i, g in enumerate(sums):
        if g is not None and g.layout != torch.strided:
            sums[i] = g.coalesce()  # one value per element: its norm and clamp are the tensor's
    grads = [g if g.layout == torch.strided else g._values() for g in sums if g is not None]
    if not grads:
        return None
    with torch.no_grad():
        if max_value is not None:
            for group in _groups(grads):
                torch._foreach_clamp_min_(group, -max_value)
                torch._foreach_clamp_max_(group, max_value)
            return None
        if max_norm is None:
            return None
        norm = total_norm(grads)
        factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for group in _groups(grads):
            torch._foreach_mul_(group, factor.to(group[0].device))
        return norm
