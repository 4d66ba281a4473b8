"""How a loop's updates run: one typed, frozen record built once per loop.

The loops build it from their config when their optimizer history is known
(``StepOptions.of``), with the ``Reduction`` they chose when they started; the public
one-update calls build one per call (``StepOptions.checked``). The step reads it;
nothing forwards its fields one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ...optim.clipping import check_clip
from ...optim.layout import GENERIC, NATIVE
from ...validate import check_choice
from ..runner.precision import LossScaler

ACCUMULATION_MODES = ("exact", "vectorized")
NONFINITE_MODES = ("raise", "skip")


@dataclass(frozen=True, eq=False)
class StepOptions:
    """``native``: the update path of the history (device mirrors) or the host path;
    ``accumulation``: ``"exact"`` (the left-to-right fold) or ``"vectorized"``;
    ``nonfinite``: ``"raise"`` (one flag read per step) or ``"skip"`` (undone on the
    device); clipping by norm or by value (at most one); ``skipped``: a device counter the
    skipped steps are added to; ``scaler``: float16 loss scaling (its steps skip an
    overflow). ``reduction`` (required): how the processes share the update
    (``reduction.py``; ``parallel.strategy.choose`` picks it); ``item_seeds``: each item
    draws from a generator seeded for it (``runner/item_seeds.py``)."""

    reduction: Any  # a Reduction (reduction.py, which reads this record)
    native: bool = False
    accumulation: str = "exact"
    nonfinite: str = "raise"
    clip_grad_norm: Optional[float] = None
    clip_grad_value: Optional[float] = None
    skipped: Optional[torch.Tensor] = None
    scaler: Optional[LossScaler] = None
    item_seeds: bool = False  # each item draws from a generator seeded for it (runner/item_seeds.py)
    # derived in __post_init__: the path's name, whether clipping, whether skipping
    path: str = field(init=False, default=GENERIC)
    clipping: bool = field(init=False, default=False)
    skips: bool = field(init=False, default=False)

    @classmethod
    def checked(cls, op: str, **kw) -> "StepOptions":
        """Options from a public call's arguments, each checked (``op`` names the call);
        each item draws what it draws in one process, as a loop's by default."""
        options = cls(**dict(kw, item_seeds=seeding(kw["reduction"])))
        check_choice(op, "accumulation", options.accumulation, ACCUMULATION_MODES)
        check_choice(op, "nonfinite", options.nonfinite, NONFINITE_MODES)
        check_clip(op, options.clip_grad_norm, options.clip_grad_value)
        return options

    @classmethod
    def of(cls, cfg, reduction, native: bool, skipped: Optional[torch.Tensor] = None,
           scaler: Optional[LossScaler] = None) -> "StepOptions":
        """A loop's options, from its (already validated) config and its chosen reduction."""
        return cls(reduction, native, cfg.accumulation, cfg.nonfinite, cfg.clip_grad_norm, cfg.clip_grad_value,
                   skipped, scaler, seeding(reduction, cfg.parallel.item_seeds))

    def __post_init__(self) -> None:
        # Read by every update: plain fields, computed once (not properties).
        object.__setattr__(self, "path", NATIVE if self.native else GENERIC)
        object.__setattr__(self, "clipping", self.clip_grad_norm is not None or self.clip_grad_value is not None)
        # a non-finite step is skipped on the device (float16 scaling always skips)
        object.__setattr__(self, "skips", self.nonfinite == "skip" or self.scaler is not None)


def seeding(reduction, asked: Optional[bool] = None) -> bool:
    """Whether each item draws from a generator seeded for it (``runner/item_seeds.py``):
    only where ``asked``. By default every item draws what it draws in one process on any
    number of ranks (``Binding.item_starts``), the plain loop's numbers. Never with
    rank-local data (each rank's items are its own: nothing to line up)."""
    return bool(asked) and not reduction.local
