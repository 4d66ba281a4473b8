"""A schedule driven by the evaluation metric: torch's ``ReduceLROnPlateau``. The rate is
multiplied by ``factor`` when the monitored metric has not improved for more than
``patience`` evaluations (then ``cooldown`` evaluations pass before counting again),
never below ``min_lr``. A loop feeds it each evaluation's ``monitor`` value (it needs
``eval_data``) and keeps its counters in every checkpoint, so a resumed run reduces the
rate when the uninterrupted one would have. Unlike the other schedules it has state: use
one object per run.
"""

from __future__ import annotations

import math
from typing import Optional

from ...errors import ConfigError
from ...validate import check_count, is_number
from ..hyper import check_rate
from .upstream import Schedule


class Plateau(Schedule):
    """``lr_at`` is the current rate, whatever the index."""

    constructor = "plateau"
    fed_by_evaluations = True  # the loop feeds it (loop_checks.loop_callbacks): only as the run's scheduler

    def __init__(self, base: float, monitor: str = "loss", mode: str = "min", factor: float = 0.1, patience: int = 10,
                 threshold: float = 1e-4, threshold_mode: str = "rel", cooldown: int = 0, min_lr: float = 0.0,
                 eps: float = 1e-8) -> None:
        op = "optim.plateau"
        self.base = check_rate(op, "base", base)
        if not isinstance(monitor, str) or not monitor:
            raise ConfigError(f"{op}: monitor must name an evaluation result (e.g. 'loss'), got {monitor!r}")
        if mode not in ("min", "max"):
            raise ConfigError(f"{op}: mode must be 'min' or 'max', got {mode!r}")
        if threshold_mode not in ("rel", "abs"):
            raise ConfigError(f"{op}: threshold_mode must be 'rel' or 'abs', got {threshold_mode!r}")
        if not (is_number(factor) and 0.0 <= factor < 1.0):
            raise ConfigError(f"{op}: factor must be in [0, 1), got {factor!r}")
        check_count(op, "patience", patience, 0)
        check_count(op, "cooldown", cooldown, 0)
        self.monitor, self.mode, self.factor, self.patience = monitor, mode, float(factor), patience
        self.threshold = check_rate(op, "threshold", threshold)
        self.threshold_mode, self.cooldown = threshold_mode, cooldown
        self.min_lr, self.eps = check_rate(op, "min_lr", min_lr), check_rate(op, "eps", eps)
        self.reset()

    bases: tuple = ()  # each param group's starting rate (``ReduceLROnPlateau`` on a grouped optimizer)
    min_lrs: tuple = ()
    start: Optional[dict] = None  # a port's counters (``optim.from_torch`` of a scheduler taken mid-run)

    def reset(self) -> None:
        """Back to the start of a run: the base rate, no best value, no counters; or, for a
        scheduler ported mid-run, the rates and counters torch's held then (its best, bad
        epochs and cooldown: torch's next ``step(value)`` continues from them)."""
        self.lrs = list(self.bases or (self.base,))
        self.best = math.inf if self.mode == "min" else -math.inf
        self.bad = self.cooldown_left = 0
        if self.start is not None:
            self.load_state_dict(self.start)

    @property
    def lr(self) -> float:
        """The (first group's) current rate."""
        return self.lrs[0]

    def lr_at(self, t: int) -> float:
        return self.lrs[0]

    def rates_at(self, t: int) -> tuple:
        return tuple(self.lrs), None

    def max_rate(self) -> float:
        return max(self.bases or (self.base,))

    def _better(self, value: float) -> bool:
        if self.mode == "min":
            bar = self.best * (1.0 - self.threshold) if self.threshold_mode == "rel" else self.best - self.threshold
            return value < bar
        bar = self.best * (self.threshold + 1.0) if self.threshold_mode == "rel" else self.best + self.threshold
        return value > bar

    def observe(self, value: float) -> None:
        """One evaluation's value of the monitored metric, as ``scheduler.step(value)``."""
        value = float(value)
        if self._better(value):
            self.best, self.bad = value, 0
        else:
            self.bad += 1
        if self.cooldown_left > 0:
            self.cooldown_left -= 1
            self.bad = 0
        if self.bad > self.patience:
            for k, lr in enumerate(self.lrs):
                new = max(lr * self.factor, self.min_lrs[k] if self.min_lrs else self.min_lr)
                if lr - new > self.eps:
                    self.lrs[k] = new
            self.cooldown_left, self.bad = self.cooldown, 0

    def state_dict(self) -> dict:
        """The counters a resumed run continues from (JSON data)."""
        best = self.best if math.isfinite(self.best) else None
        return {"lr": self.lrs[0], "lrs": list(self.lrs), "best": best, "bad": self.bad,
                "cooldown_left": self.cooldown_left}

    def load_state_dict(self, state: dict) -> None:
        """Take back the counters ``state_dict`` gave (a resumed run)."""
        problems = [k for k in ("lr", "best", "bad", "cooldown_left") if k not in state]
        if problems or not (is_number(state["lr"]) and state["lr"] >= 0):
            raise ConfigError(f"optim.plateau: a saved state needs lr, best, bad and cooldown_left; got {state!r}")
        lrs = state.get("lrs", [state["lr"]])
        if not (isinstance(lrs, list) and len(lrs) == len(self.lrs) and all(is_number(r) and r >= 0 for r in lrs)):
            raise ConfigError(f"optim.plateau: a saved state has the rates {lrs!r}; this schedule has "
                              f"{len(self.lrs)} param group(s)")
        self.lrs = [float(r) for r in lrs]
        self.best = (math.inf if self.mode == "min" else -math.inf) if state["best"] is None else float(state["best"])
        self.bad, self.cooldown_left = int(state["bad"]), int(state["cooldown_left"])

    def __repr__(self) -> str:
        return (f"plateau(base={self.base!r}, monitor={self.monitor!r}, mode={self.mode!r}, factor={self.factor!r}, "
                f"patience={self.patience!r})")


__all__ = ["Plateau"]
