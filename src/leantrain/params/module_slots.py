"""Reading an ``nn.Module`` as parameter slots, and binding tensors into it for a call.

Slot order: ``named_parameters(remove_duplicate=False)`` (so a shared
``nn.Parameter`` appears at every place it is registered), then the *persistent*
buffers of ``named_buffers(remove_duplicate=False)`` as frozen slots: exactly the
entries of ``module.state_dict()``. Non-persistent buffers (a causal mask registered
with ``persistent=False``) are the module's own scratch: not slots, never saved.

Storage identity is memory: two tensors with the same data pointer, shape, stride,
dtype and device are one storage. Zero-size tensors hold no memory, so two of them
are one storage only when they are the same tensor object. Views whose elements
share a byte but differ in layout (a partial overlap) are an ``AliasError``; views
of one base that share no element (``base[0::2]`` and ``base[1::2]``) are separate.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import AliasError, ConfigError, PackTypeError, shape_str, slot_label
from .param import Param
from .storage import Storage

# Above this many elements in a strided (non-dense) view, overlap is not enumerated
# element by element; such a pair is refused as "may overlap" instead.
EXACT_OVERLAP_LIMIT = 1 << 22


class SlotLocation(NamedTuple):
    """Where a slot lives in the module: ``owner._parameters[attr]`` or ``_buffers``."""

    owner: torch.nn.Module
    attr: str
    is_parameter: bool

    def current(self):
        """The tensor the module holds here now (``None`` when the entry is gone)."""
        table = self.owner._parameters if self.is_parameter else self.owner._buffers
        return table.get(self.attr)


def module_entries(
    module: torch.nn.Module, persistent: bool = True
) -> list[tuple[str, torch.Tensor, SlotLocation]]:
    """(name, tensor, location) per slot, parameters first, then the persistent
    buffers (``persistent=False``: the non-persistent ones instead, and no parameters)."""
    out = []
    if persistent:
        for name, p in module.named_parameters(remove_duplicate=False):
            out.append((name, p, _location(module, name, True)))
    for name, b in module.named_buffers(remove_duplicate=False):
        if b is None:
            continue
        loc = _location(module, name, False)
        if (loc.attr not in loc.owner._non_persistent_buffers_set) == persistent:
            out.append((name, b, loc))
    return out


def module_slots(module: torch.nn.Module) -> list[Param]:
    """The views of ``module``'s state, one per slot, sharing storages by memory view."""
    if not isinstance(module, torch.nn.Module):
        raise PackTypeError(
            f"ParamList.from_module: expected a torch.nn.Module, got {type(module).__name__}"
        )
    entries = module_entries(module)
    for i, (name, t, _) in enumerate(entries):
        if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):
            raise ConfigError(
                f"ParamList.from_module: {slot_label(i, name)} is an uninitialized (lazy) "
                f"parameter; run one forward pass on a sample first so its shape is known"
            )
    check_no_partial_overlap("ParamList.from_module", [(n, t) for n, t, _ in entries])
    by_view: dict[tuple, Storage] = {}
    views = []
    for name, t, loc in entries:
        storage = by_view.setdefault(view_key(t), Storage(t))
        trainable = loc.is_parameter and t.requires_grad
        views.append(Param.of_storage(storage, requires_grad=trainable, name=_plain_name(name)))
    return views


def _plain_name(name: str) -> str:
    """The name without the ``_orig_mod.`` a ``torch.compile`` wrapper adds, so weights
    and checkpoints of a compiled model fit the plain model and back."""
    return name.removeprefix("_orig_mod.")


def bind(location: SlotLocation, tensor: torch.Tensor) -> None:
    """Make the module read ``tensor`` at ``location`` (no copy, no type check).

    Recurrent modules keep their own list of weight references (``_flat_weights``,
    what their forward reads); it is kept in step, as their ``__setattr__`` does.
    """
    owner, attr = location.owner, location.attr
    (owner._parameters if location.is_parameter else owner._buffers)[attr] = tensor
    names = getattr(owner, "_flat_weights_names", None)
    if names is not None and attr in names:
        owner._flat_weights[names.index(attr)] = tensor


def _location(module: torch.nn.Module, name: str, is_parameter: bool) -> SlotLocation:
    prefix, _, attr = name.rpartition(".")
    owner = module.get_submodule(prefix) if prefix else module
    return SlotLocation(owner, attr, is_parameter)


def view_key(t: torch.Tensor) -> tuple:
    """What makes two tensors the same slot's storage: the same memory seen the same way."""
    if t.numel() == 0:
        return ("empty", id(t))  # no memory: the same object or nothing
    return (t.device, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return (t.data_ptr(), t.data_ptr() + extent * t.element_size())


def _is_dense(t: torch.Tensor) -> bool:
    """Every byte of the span belongs to an element (some permutation is contiguous)."""
    start, end = _byte_span(t)
    return (end - start) == t.numel() * t.element_size()


def _element_starts(t: torch.Tensor) -> torch.Tensor:
    """The sorted byte offsets (from the data pointer) of every element of ``t``."""
    offsets = torch.zeros((), dtype=torch.int64)
    for n, s in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * (s * t.element_size())
    return offsets.reshape(-1).sort().values


def _share_a_byte(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact: does some element of ``a`` share a byte with some element of ``b``?"""
    if _is_dense(a) and _is_dense(b):
        return True  # both cover their spans, and the spans intersect
    if max(a.numel(), b.numel()) > EXACT_OVERLAP_LIMIT:
        return True  # too large to enumerate: refused as "may overlap"
    base = min(a.data_ptr(), b.data_ptr())
    sa = _element_starts(a) + (a.data_ptr() - base)
    sb = _element_starts(b) + (b.data_ptr() - base)
    ea, eb = a.element_size(), b.element_size()
    # For each element of b, the last element of a starting before b's element ends.
    k = torch.searchsorted(sa, sb + eb, right=False) - 1
    valid = k >= 0
    return bool((sa[k.clamp(min=0)] + ea > sb)[valid].any())


def check_no_partial_overlap(op: str, entries: list[tuple[str, torch.Tensor]]) -> None:
    """Different views that share a byte can be neither one storage nor two."""
    spans = []
    for i, (name, t) in enumerate(entries):
        if t.numel() > 0:
            start, end = _byte_span(t)
            spans.append((str(t.device), start, end, i))
    spans.sort()
    active: list[tuple] = []  # spans on this device that may still reach the next start
    for s in spans:
        active = [a for a in active if a[0] == s[0] and a[2] > s[1]]
        for a in active:
            (name_i, t_i), (name_j, t_j) = entries[a[3]], entries[s[3]]
            if view_key(t_i) == view_key(t_j) or not _share_a_byte(t_i, t_j):
                continue
            i, j = sorted((a[3], s[3]))
            (name_i, t_i), (name_j, t_j) = entries[i], entries[j]
            big = max(t_i.numel(), t_j.numel()) > EXACT_OVERLAP_LIMIT and not (
                _is_dense(t_i) and _is_dense(t_j)
            )
            verb = "may overlap (too large to check element by element)" if big else "overlap"
            raise AliasError(
                f"{op}: {slot_label(i, name_i)} and {slot_label(j, name_j)} {verb} in memory "
                f"with different views: shape {shape_str(t_i.shape)} stride {tuple(t_i.stride())} "
                f"vs shape {shape_str(t_j.shape)} stride {tuple(t_j.stride())}; give each its "
                f"own tensor or tie the whole tensor"
            )
        active.append(s)
