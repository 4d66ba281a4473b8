"""Gradient packs: shape-aligned arithmetic and the canonical (alias-summed) gradients.

A gradient pack has one entry per slot. ``None`` stands for "no gradient" and is
only accepted where nothing reads it (frozen slots, which are dropped).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..errors import PackError, PackTypeError, shape_str, slot_label

Pack = Sequence[Optional[torch.Tensor]]


def _name(names, i: int) -> Optional[str]:
    """Slot ``i``'s name from a list of names or a ParamList (read only for messages)."""
    if names is None or i >= len(names):
        return None
    return getattr(names[i], "name", names[i])


def canonical_gradients(
    slots: Sequence[Optional[int]],
    gradients: Pack,
    *,
    names: Optional[Sequence[Optional[str]]] = None,
    allow_missing: bool = False,
) -> list[Optional[torch.Tensor]]:
    """Sum occurrence gradients at their representative slots, in slot order.

    ``slots`` is a canonical map (``ParamList.canonical_slot_indices()``). Frozen
    slots (``None``) contribute nothing, even when their storage is trainable
    elsewhere. A representative's first gradient is kept as is (no ``0 + g``), so an
    unaliased slot sees exactly its own gradient; later occurrences are added left to
    right, ``((g_a + g_b) + g_c)``. The result has ``None`` at aliases and frozen
    slots. Nothing is mutated; a bad map or pack raises before anything is returned.

    ``allow_missing``: ``None`` at a trainable slot means "no gradient" (the forward did
    not use it, torch's ``.grad is None``): it adds nothing, and a storage none of whose
    occurrences has a gradient gets ``None``.
    """
    op = "canonical_gradients"
    if len(slots) != len(gradients):
        raise PackError(
            f"{op}: canonical map length mismatch: map has {len(slots)} slots, "
            f"gradient pack has {len(gradients)}"
        )
    sums: list[Optional[torch.Tensor]] = [None] * len(slots)
    for i, c in enumerate(slots):
        if c is None:
            continue
        if type(c) is not int or not 0 <= c <= i or slots[c] != c:
            raise PackError(
                f"{op}: {slot_label(i, _name(names, i))}: invalid canonical slot {c!r}: expected a representative "
                f"index <= {i} that maps to itself"
            )
        g = gradients[i]
        if g is None and allow_missing:
            continue
        if not isinstance(g, torch.Tensor):
            what = "missing gradient (None)" if g is None else type(g).__name__
            raise PackTypeError(
                f"{op}: {slot_label(i, _name(names, i))}: expected a gradient tensor, got {what}"
            )
        acc = sums[c]
        if acc is None:
            sums[c] = g
            continue
        if acc.shape != g.shape or acc.dtype != g.dtype:
            raise PackError(
                f"{op}: {slot_label(i, _name(names, i))}: gradient does not match its representative "
                f"{slot_label(c, _name(names, c))}: expected shape {shape_str(acc.shape)} "
                f"{acc.dtype}, got {shape_str(g.shape)} {g.dtype}"
            )
        # addition commutes bit for bit; torch adds a sparse tensor only to a dense one
        sums[c] = g + acc if acc.layout != torch.strided and g.layout == torch.strided else acc + g
    return sums


def canonical_gradient(
    shape: Sequence[int], sums: Sequence[Optional[torch.Tensor]], index: int
) -> torch.Tensor:
    """Read the canonical gradient at ``index``, checking that it exists and its shape."""
    op = "canonical_gradient"
    if not 0 <= index < len(sums) or sums[index] is None:
        raise PackError(
            f"{op}: slot {index}: no canonical gradient there (frozen, an alias, or out of "
            f"range for {len(sums)} slots)"
        )
    g = sums[index]
    if tuple(g.shape) != tuple(shape):
        raise PackError(
            f"{op}: slot {index}: expected shape {shape_str(shape)}, got {shape_str(g.shape)}"
        )
    return g


def _check_aligned(op: str, a: Pack, b: Pack) -> None:
    if len(a) != len(b):
        raise PackError(f"{op}: pack length mismatch: {len(a)} vs {len(b)} slots")
    for i, (x, y) in enumerate(zip(a, b)):
        if (x is None) != (y is None):
            raise PackError(f"{op}: slot {i}: one pack has no gradient there, the other has")
        if x is not None and (x.shape != y.shape or x.dtype != y.dtype):
            raise PackError(
                f"{op}: slot {i}: shape mismatch: {shape_str(x.shape)} {x.dtype} vs "
                f"{shape_str(y.shape)} {y.dtype}"
            )


def add_gradient_packs(a: Pack, b: Pack) -> list[Optional[torch.Tensor]]:
    """Slotwise ``a + b``; every result is a new tensor. ``None`` slots stay ``None``."""
    _check_aligned("add_gradient_packs", a, b)
    return [None if x is None else x + y for x, y in zip(a, b)]


def scale_gradient_pack(c: float, a: Pack) -> list[Optional[torch.Tensor]]:
    """Slotwise ``a * c``; every result is a new tensor. ``None`` slots stay ``None``."""
    return [None if x is None else x * c for x in a]

