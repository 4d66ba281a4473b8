"""transformers' ``GreedyLR`` (Trainer's ``lr_scheduler_type="greedy"``): a schedule fed by
evaluations, like the plateau schedule, that also *raises* the rate: divided by
``factor`` after more than ``patience`` improving evaluations (up to ``max_lr``),
multiplied by it after more than ``patience`` bad ones (down to ``min_lr``); ``cooldown``
evaluations after a cut and ``warmup`` after a rise are not counted; ``smooth`` averages
the monitored value over the last ``window_size`` evaluations; a rate held at ``min_lr``
for ``reset_start`` cuts starts over. Each rule in transformers' order, so the rates are
its rates (tested); the counters are kept in every checkpoint.
"""

from __future__ import annotations

import math

from ...errors import ConfigError
from ...validate import check_count, is_number
from .plateau import Plateau


class Greedy(Plateau):
    """transformers' ``GreedyLR`` over the loop's evaluations (``monitor``: a key of the
    evaluation results)."""

    fed_by_evaluations = True
    constructor = "greedy"

    def __init__(self, base, monitor: str = "loss", mode: str = "min", factor: float = 0.95, patience: int = 10,
                 threshold: float = 1e-6, threshold_mode: str = "abs", cooldown: int = 0, warmup: int = 0,
                 min_lr=1e-3, max_lr=1.0, eps: float = 1e-8, smooth: bool = False, window_size: int = 50,
                 reset_start: int = 500) -> None:
        from .lr_scheduler.replay import describe, per_group

        op = "optim.greedy"
        bases, _, _ = describe(base)
        if not (is_number(factor) and 0.0 < factor < 1.0):
            raise ConfigError(f"{op}: factor must be in (0, 1), got {factor!r}")
        self.min_lrs = tuple(per_group(op, "min_lr", min_lr, len(bases)))
        self.max_lrs = tuple(per_group(op, "max_lr", max_lr, len(bases)))
        for name, values in (("min_lr", self.min_lrs), ("max_lr", self.max_lrs)):
            if not all(is_number(v) and 0 <= v < math.inf for v in values):
                raise ConfigError(f"{op}: {name} must be a finite rate >= 0 (or one per param group), got {values!r}")
        self.warmup = check_count(op, "warmup", warmup, 0)
        self.window_size = check_count(op, "window_size", window_size, 1)
        self.reset_start_original = check_count(op, "reset_start", reset_start, 0)
        if not isinstance(smooth, bool):
            raise ConfigError(f"{op}: smooth must be True or False, got {smooth!r}")
        self.smooth = smooth
        self.bases = tuple(bases)
        super().__init__(bases[0], monitor, mode, factor, patience, threshold, threshold_mode, cooldown,
                         min(self.min_lrs), eps)

    def reset(self) -> None:
        super().reset()
        self.good = self.warmup_left = 0
        self.reset_left = self.reset_start_original
        self.window: list[float] = []
        self.window_sum = 0.0

    def _average(self, value: float) -> float:
        self.window.append(value)
        self.window_sum += value
        if len(self.window) > self.window_size:
            self.window_sum -= self.window.pop(0)
        return self.window_sum / len(self.window)

    def observe(self, value: float) -> None:
        """One evaluation's value, as ``GreedyLR.step(value)``."""
        value = float(value)
        if self.smooth:
            value = self._average(value)
        if self.cooldown_left > 0:
            self.cooldown_left -= 1
            self.bad = self.good = 0
        elif self.warmup_left > 0:
            self.warmup_left -= 1
            self.bad = self.good = 0
        else:
            if self._better(value):
                self.best, self.bad = value, 0
                self.good += 1
            else:
                self.bad += 1
                self.good = 0
            if self.good > self.patience:
                self._raise()
                self.warmup_left, self.good = self.warmup, 0
            elif self.bad > self.patience:
                self._cut()
                self.cooldown_left, self.bad = self.cooldown, 0

    def _better(self, value: float) -> bool:
        if self.mode == "min":
            return value < (self.best * (1.0 - self.threshold) if self.threshold_mode == "rel"
                            else self.best - self.threshold)
        return value > (self.best * (1.0 + self.threshold) if self.threshold_mode == "rel"
                        else self.best + self.threshold)

    def _cut(self) -> None:
        at_min = True
        for k, lr in enumerate(self.lrs):
            new = max(lr * self.factor, self.min_lrs[k])
            if lr - new > self.eps:
                self.lrs[k] = new
            if self.lrs[k] > self.min_lrs[k]:
                at_min = False
        if at_min:
            self.reset_left -= 1
            if self.reset_left <= 0:
                self.reset()

    def _raise(self) -> None:
        for k, lr in enumerate(self.lrs):
            new = min(lr / self.factor, self.max_lrs[k])
            if new - lr > self.eps:
                self.lrs[k] = new
        self.reset_left = self.reset_start_original

    def max_rate(self) -> float:
        return max(max(self.bases), max(self.max_lrs))

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.update(good=self.good, warmup_left=self.warmup_left, reset_left=self.reset_left,
                     window=list(self.window), window_sum=self.window_sum)
        return state

    def load_state_dict(self, state: dict) -> None:
        missing = [k for k in ("good", "warmup_left", "reset_left", "window", "window_sum") if k not in state]
        if missing:
            raise ConfigError(f"optim.greedy: a saved state lacks {missing}; it was not saved by a greedy schedule")
        super().load_state_dict(state)
        self.good, self.warmup_left, self.reset_left = int(state["good"]), int(state["warmup_left"]), int(
            state["reset_left"])
        self.window, self.window_sum = [float(v) for v in state["window"]], float(state["window_sum"])

    def __repr__(self) -> str:
        return f"greedy(groups={len(self.bases)}, monitor={self.monitor!r}, factor={self.factor!r})"
