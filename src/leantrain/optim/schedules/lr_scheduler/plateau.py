"""torch's ``ReduceLROnPlateau`` by its own name and arguments: each param group's rate
times ``factor`` when the monitored value stops improving, never below the group's
``min_lr`` (one value, or a list: one per group). The loop feeds it each evaluation's
``monitor`` value (``"loss"`` by default; torch's ``step(metric)``) and keeps its
counters in checkpoints (``optim.plateau``)."""

from __future__ import annotations

from ....errors import ConfigError
from ....validate import is_number
from ..plateau import Plateau
from .replay import describe, per_group


class ReduceLROnPlateau(Plateau):
    """``optim.plateau`` with torch's signature: the optimizer first (its groups' rates)."""

    torch_name = "ReduceLROnPlateau"

    def __init__(self, optimizer, mode: str = "min", factor: float = 0.1, patience: int = 10,
                 threshold: float = 1e-4, threshold_mode: str = "rel", cooldown: int = 0, min_lr=0.0,
                 eps: float = 1e-8, *, monitor: str = "loss") -> None:
        op = "lr_scheduler.ReduceLROnPlateau"
        bases, _, _ = describe(optimizer)
        min_lrs = per_group(op, "min_lr", min_lr, len(bases))
        if not all(is_number(m) and m >= 0 for m in min_lrs):
            raise ConfigError(f"{op}: min_lr must be a rate >= 0 (or one per param group), got {min_lr!r}")
        self.bases, self.min_lrs = tuple(bases), tuple(float(m) for m in min_lrs)
        super().__init__(bases[0], monitor, mode, factor, patience, threshold, threshold_mode, cooldown,
                         min(self.min_lrs), eps)

    def __repr__(self) -> str:
        return (f"ReduceLROnPlateau(groups={len(self.bases)}, monitor={self.monitor!r}, mode={self.mode!r}, "
                f"factor={self.factor!r}, patience={self.patience!r})")
