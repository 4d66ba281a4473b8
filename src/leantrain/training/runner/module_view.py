"""Where each slot lives in the user's module, and how one call binds it (``Binding``).

A ``ModuleView`` is read once from the module when its ``Runner`` is built: per slot,
the module's table and attribute name, the original object, its ``requires_grad`` then
(parameters) and whether it lives on the runner's device. ``bind`` checks first that
the module still holds those objects (a replaced parameter or buffer is refused naming
the slot; a ``requires_grad`` turned on or off there is followed), then gives each
trainable slot a leaf: the module's own tensor in the common case, its device mirror
when computing elsewhere, and a later occurrence of a tie its own leaf over the same
memory (its gradient is its own occurrence's, summed later in slot order); under torch's
DDP (``runner.one_leaf_per_tensor``) the tied Parameter itself at every occurrence, its one
``.grad`` the occurrences' sum, as in a plain torch loop.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...errors import ConfigError, slot_label
from ...params.module_slots import module_entries
from .binding import Binding


class ModuleView:
    """The module's slots as the runner binds them (read once, when the runner is built)."""

    def __init__(self, module: torch.nn.Module) -> None:
        entries = module_entries(module)
        self.locations = [loc for _, _, loc in entries]
        self.originals = [t for _, t, _ in entries]  # the module's own objects, per slot
        self.buffer_slots = [i for i, loc in enumerate(self.locations) if not loc.is_parameter]
        self.scratch_locations = [loc for _, _, loc in module_entries(module, persistent=False)]
        self.device_copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.slot_info: list = []

    def index(self, device: torch.device) -> None:
        """Per slot, what ``bind`` reads each call: the module's table and name, the
        original object, its requires_grad at build (parameters), and whether it lives
        on ``device``."""
        self.slot_info = [
            (
                loc.owner._parameters if loc.is_parameter else loc.owner._buffers,
                loc.attr,
                orig,
                bool(orig.requires_grad) if loc.is_parameter else None,
                orig.device == device,
            )
            for loc, orig in zip(self.locations, self.originals)
        ]

    def bind(self, runner, op: str) -> Binding:
        """A new binding of the module at the runner's current values (see the module
        docstring)."""
        views, dev = runner.params, runner.device
        slots_map = runner.slot_map()
        leaves: list[Optional[torch.Tensor]] = [None] * len(views)
        working = list(self.originals)
        swaps: list = []
        leaf_ids: set[int] = set()
        one_leaf = runner.one_leaf_per_tensor
        for i, (table, attr, orig, trainable, on_device) in enumerate(self.slot_info):
            if table.get(attr) is not orig:
                raise self.changed(op, i, views)
            if trainable is not None and orig.requires_grad is not trainable:
                runner.follow_changed_requires_grad()  # rare: the trainable set changed; bind it afresh
                return self.bind(runner, op)
            s = views[i].storage
            m = s.mirror
            if m is None and on_device:
                w = orig  # the common case: the module's own tensor, nothing to bind
            elif m is not None and m.device == dev:
                w = m
            elif orig.device == dev:
                s.sync_to_host()  # a mirror elsewhere may be newer (a sync, rare)
                w = orig
            else:
                w = s.make_mirror(dev)  # a host-to-device upload, never a read back
            if one_leaf and slots_map[i] is not None and id(w) in leaf_ids:
                pass  # torch's DDP: the tied Parameter at every occurrence, one .grad (autograd's sum)
            elif slots_map[i] is not None:
                if id(w) in leaf_ids or not w.requires_grad:
                    # A later occurrence of a tie gets its own leaf over the same memory,
                    # so its gradient is its own occurrence's (summed later in slot order).
                    w = w.detach().requires_grad_(True)
                leaf_ids.add(id(w))
                leaves[i] = w
            elif w.requires_grad:
                w = w.detach()  # a frozen view of a trainable storage passes no gradient
            if w is not orig:
                working[i] = w
                swaps.append((self.locations[i], w, orig))
        for j, loc in enumerate(self.scratch_locations):
            cur = loc.current()
            if cur is not None and cur.device != dev:
                src, copy = self.device_copies.get(j, (None, None))
                if src is not cur:
                    copy = cur.to(dev)
                    self.device_copies[j] = (cur, copy)
                swaps.append((loc, copy, cur))
        return Binding(runner, leaves, working, swaps)

    def fingerprint(self, params) -> list:
        """What a loop's checks depend on, per slot: the object the module holds there, the
        module's and the slot's ``requires_grad``, the tensor's memory (address, shape,
        strides, dtype, device) and its device mirror; per non-persistent buffer, the
        object and its device. Equal fingerprints before and after the user's code mean
        the loop's checks still hold (``Runner.confirm_steady``)."""
        out: list = []
        for (table, attr, orig, _, _), p in zip(self.slot_info, params.views):
            out.append((id(table.get(attr)), orig.requires_grad, p.requires_grad, orig.data_ptr(), orig.shape,
                        orig.stride(), orig.dtype, orig.device, id(p.storage.mirror)))
        for loc in self.scratch_locations:
            cur = loc.current()
            out.append((id(cur), None if cur is None else cur.device))
        return out

    def changed_requires_grad(self) -> list[int]:
        """The slots whose module Parameter's ``requires_grad`` was turned on or off since
        the last ``index``."""
        return [i for i, (table, attr, orig, trainable, _) in enumerate(self.slot_info)
                if trainable is not None and table.get(attr) is orig and orig.requires_grad is not trainable]

    def trainable_wanted(self, mask) -> dict[int, bool]:
        """Per module Parameter (by id), whether any of its slots trains under ``mask``."""
        wants: dict[int, bool] = {}
        for i, flag in enumerate(mask):
            if self.locations[i].is_parameter:
                wants[id(self.originals[i])] = wants.get(id(self.originals[i]), False) or bool(flag)
        return wants

    def changed(self, op: str, i: int, params) -> ConfigError:
        """The error for slot ``i``'s object replaced (or removed) on the module."""
        kind = "parameter" if self.locations[i].is_parameter else "buffer"
        return ConfigError(
            f"{op}: {slot_label(i, params[i].name)}: the module's {kind} was replaced (or removed) after the "
            f"Runner was built, so the Runner would train something else than the module holds; build a new "
            f"Runner (and optimizer state) for the changed module"
        )
