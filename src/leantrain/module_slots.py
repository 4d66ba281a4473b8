"""Reading an ``nn.Module`` as parameter slots, and binding tensors back into it.

Slot order: ``named_parameters(remove_duplicate=False)`` (so a shared
``nn.Parameter`` appears at every place it is registered), then
``named_buffers(remove_duplicate=False)`` as frozen slots. Storage identity is
the memory view: two tensors with the same data pointer, shape, stride, dtype
and device are one storage; an overlap between different views is an error.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .errors import AliasError, shape_str, slot_label
from .params import Param
from .storage import Storage


class SlotLocation(NamedTuple):
    """Where a slot lives in the module: ``owner._parameters[attr]`` or ``_buffers``."""

    owner: torch.nn.Module
    attr: str
    is_parameter: bool


def module_entries(module: torch.nn.Module) -> list[tuple[str, torch.Tensor, SlotLocation]]:
    """(name, tensor, location) per slot, parameters first, then buffers."""
    out = []
    for name, p in module.named_parameters(remove_duplicate=False):
        out.append((name, p, _location(module, name, True)))
    for name, b in module.named_buffers(remove_duplicate=False):
        if b is None:
            continue
        out.append((name, b, _location(module, name, False)))
    return out


def module_slots(module: torch.nn.Module) -> list[Param]:
    """The views of ``module``'s state, one per slot, sharing storages by memory view."""
    if not isinstance(module, torch.nn.Module):
        from .errors import PackTypeError

        raise PackTypeError(
            f"ParamList.from_module: expected a torch.nn.Module, got {type(module).__name__}"
        )
    entries = module_entries(module)
    _check_no_partial_overlap(entries)
    by_view: dict[tuple, Storage] = {}
    views = []
    for name, t, loc in entries:
        storage = by_view.setdefault(_view_key(t), Storage(t))
        trainable = loc.is_parameter and t.requires_grad
        views.append(Param.of_storage(storage, requires_grad=trainable, name=name))
    return views


def bind(location: SlotLocation, tensor: torch.Tensor) -> None:
    """Make the module read ``tensor`` at ``location`` (no copy, no type check)."""
    table = location.owner._parameters if location.is_parameter else location.owner._buffers
    table[location.attr] = tensor


def _location(module: torch.nn.Module, name: str, is_parameter: bool) -> SlotLocation:
    prefix, _, attr = name.rpartition(".")
    owner = module.get_submodule(prefix) if prefix else module
    return SlotLocation(owner, attr, is_parameter)


def _view_key(t: torch.Tensor) -> tuple:
    return (t.device, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return (t.data_ptr(), t.data_ptr() + extent * t.element_size())


def _check_no_partial_overlap(entries) -> None:
    """Different views whose byte ranges intersect cannot be one storage nor two."""
    spans = []
    for i, (name, t, _) in enumerate(entries):
        start, end = _byte_span(t)
        if end > start:
            spans.append((str(t.device), start, end, _view_key(t), i, name, t))
    spans.sort(key=lambda s: (s[0], s[1], s[2]))
    reach = None  # the span reaching furthest so far on this device
    for s in spans:
        if reach is not None and reach[0] == s[0] and s[1] < reach[2] and reach[3] != s[3]:
            _, _, _, _, i, name_i, t_i = reach
            _, _, _, _, j, name_j, t_j = s
            i, j, name_i, name_j, t_i, t_j = (
                (i, j, name_i, name_j, t_i, t_j) if i < j else (j, i, name_j, name_i, t_j, t_i)
            )
            raise AliasError(
                f"ParamList.from_module: {slot_label(i, name_i)} and {slot_label(j, name_j)} "
                f"overlap in memory with different views: shape {shape_str(t_i.shape)} stride "
                f"{tuple(t_i.stride())} vs shape {shape_str(t_j.shape)} stride "
                f"{tuple(t_j.stride())}; give each its own tensor or tie the whole tensor"
            )
        if reach is None or reach[0] != s[0] or s[2] > reach[2]:
            reach = s
