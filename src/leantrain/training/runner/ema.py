"""An exponential moving average of the trained weights (``ema_decay``).

One average per trainable storage (a tie is averaged once; frozen slots and buffers
are their current value), kept beside the storage's newest tensor (the device mirror
after a native step, else the host) and updated after every optimizer step with no
host read. The rule is ``torch.optim.swa_utils.AveragedModel`` with
``get_ema_multi_avg_fn(decay)``: the first update copies the weights, each later one is
``torch._foreach_lerp_(average, weights, 1 - decay)``. A step skipped for a non-finite
gradient (``nonfinite="skip"``) leaves the weights as they were and still counts, as
``update_parameters`` after such a step would.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch

from ...errors import ConfigError
from ...validate import is_number


def check_decay(op: str, decay: object) -> None:
    if decay is not None and not (is_number(decay) and math.isfinite(decay) and 0.0 <= decay < 1.0):
        raise ConfigError(f"{op}: ema_decay must be a number in [0, 1) or None, got {decay!r}")


class EMA:
    """The averages of ``params``' trainable storages (``values[k]``: storage ``k``'s,
    ``None`` for a frozen storage or before the first update)."""

    def __init__(self, params, decay: float, count: int = 0,
                 values: Optional[list[Optional[torch.Tensor]]] = None) -> None:
        check_decay("EMA", decay)
        self.decay, self.count = float(decay), count
        storages = params.storages()
        index = {id(s): k for k, s in enumerate(storages)}
        self.trainable = sorted({index[id(params[i].storage)] for i, c in enumerate(params.canonical_slot_indices())
                                 if c is not None})
        self.values: list[Optional[torch.Tensor]] = values if values is not None else [None] * len(storages)
        self._of, self._storages = params, storages

    def update(self, params) -> None:
        """Average in the current weights (after an optimizer step); device-side only."""
        if self._of is not params:  # the storages looked up once per parameter list
            self._of, self._storages = params, params.storages()
        storages = self._storages
        with torch.no_grad():
            if self.count == 0:
                for k in self.trainable:
                    self.values[k] = storages[k].newest().detach().clone()
            else:
                groups: dict[tuple, tuple[list, list]] = {}
                for k in self.trainable:
                    w = storages[k].newest().detach()
                    avg = self.values[k]
                    if avg.device != w.device:  # the runner moved: the average follows
                        avg = self.values[k] = avg.to(w.device)
                    group = groups.setdefault((w.device, w.dtype), ([], []))
                    group[0].append(avg), group[1].append(w)
                for avgs, ws in groups.values():
                    torch._foreach_lerp_(avgs, ws, 1.0 - self.decay)
        self.count += 1

    def storage_values(self, params) -> list[torch.Tensor]:
        """Per storage: the average, or the current value (frozen, or nothing averaged yet)."""
        return [v if v is not None else s.newest().detach() for v, s in zip(self.values, params.storages())]

    def slot_values(self, params) -> list[torch.Tensor]:
        """Per slot, copies: the averaged weights (frozen slots and buffers: their value)."""
        per_storage = self.storage_values(params)
        index = {id(s): k for k, s in enumerate(params.storages())}
        return [per_storage[index[id(v.storage)]].clone() for v in params]

    @contextlib.contextmanager
    def applied(self, params) -> Iterator[None]:
        """The averaged weights in place of the trained ones for the enclosed code (an
        evaluation), the trained ones put back after (two copies per storage)."""
        storages = params.storages()
        saved = []
        with torch.no_grad():
            for k in self.trainable:
                if self.values[k] is None:
                    continue
                s = storages[k]
                current = [s.host] + ([s.mirror] if s.mirror is not None else []) if s.host_current else [s.mirror]
                for w in current:  # every copy a computation might read
                    saved.append((w, w.detach().clone()))
                    w.copy_(self.values[k])
        try:
            yield
        finally:
            with torch.no_grad():
                for w, old in saved:
                    w.copy_(old)


def restored_ema(params, saved: dict) -> EMA:
    """The ``EMA`` a checkpoint saved (``Checkpoint.ema``), beside the storages' tensors."""
    storages = params.storages()
    values: list[Optional[torch.Tensor]] = [None] * len(storages)
    for k, t in saved["values"].items():
        values[k] = t.to(storages[k].newest().device, copy=True)
    return EMA(params, saved["decay"], saved["count"], values)
