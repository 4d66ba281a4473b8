"""Dense memory in a parameter's own layout: what every kernel call is handed.

torch's fused optimizer kernels (and the multi-tensor unscale that looks for
non-finite values) treat each tensor as ``numel`` elements from its data pointer:
they pair the k-th element in memory of the parameter with the k-th element in
memory of its gradient and state. That is right only when every tensor of the call
is *non-overlapping and dense* and all of them lay their elements out the same way.
autograd does not promise that: a transposed or channels_last parameter used
through a reshape gets a contiguous gradient, ``w.sum(0)`` gives a stride-0 one, and
a view with gaps (``base[0::2]``, a column ``base[:, 0]``) is not dense at all.

The rule, applied before any kernel:

* a parameter's *kernel layout* is its own strides when it is dense, else the dense
  layout ``torch.empty_like`` gives it (the layout its optimizer state is made in);
* a gradient or state tensor in another layout is copied into the kernel layout
  (``to_layout``); one already in it is used as it is (the usual case: no copy);
* a parameter that is not dense is updated through a dense working copy that is
  written back through its view, so only its own elements change.

Expanded (stride-0) and other self-overlapping tensors cannot be updated at all (two
elements are one memory cell): ``internal_overlap`` finds them, and trainable slots
with it are refused when a parameter list is built.
"""

from __future__ import annotations

import torch

# torch's own answer to "do two elements share memory": 0 no, 1 yes, 2 too hard to tell.
_OVERLAP_NO, _OVERLAP_YES = 0, 1
# Above this many elements an undecided layout is not enumerated; it is refused instead.
EXACT_LIMIT = 1 << 22


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements tile its memory span exactly, in some order of dims."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def kernel_strides(t: torch.Tensor) -> tuple[int, ...]:
    """The strides a kernel's view of ``t`` has: its own when dense, else
    ``empty_like``'s (contiguous, or channels_last where torch suggests it)."""
    if is_dense(t):
        return tuple(t.stride())
    return tuple(torch.empty_like(t).stride())


def same_layout(t: torch.Tensor, strides: tuple[int, ...]) -> bool:
    """Whether dense memory with ``strides`` and ``t`` pair element for element (strides
    of size-1 dims never matter). ``t`` must have the shape ``strides`` were made for."""
    own = t.stride()
    if own == strides:
        return True
    return all(a == b or n == 1 for a, b, n in zip(own, strides, t.shape)) and is_dense(t)


def to_layout(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A fresh copy of ``t``'s values in ``like``'s kernel layout, on ``like``'s device."""
    out = torch.empty_like(like)  # dense ``like``: its strides; else the dense layout
    with torch.no_grad():
        out.copy_(t)
    return out


def internal_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (an expanded dim, an ``as_strided``
    that folds onto itself). Exact below ``EXACT_LIMIT`` elements; above it an
    undecidable layout counts as overlapping."""
    if t.numel() <= 1 or t.layout != torch.strided:
        return False
    verdict = torch._debug_has_internal_overlap(t)
    if verdict == _OVERLAP_NO:
        return False
    if verdict == _OVERLAP_YES:
        return True
    if is_dense(t):
        return False
    if t.numel() > EXACT_LIMIT:
        return True
    offsets = torch.zeros((), dtype=torch.int64)
    for n, s in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * s
    return int(offsets.reshape(-1).unique().numel()) != t.numel()
