"""Schedules of ``torch.optim.lr_scheduler`` as leantrain schedules, each a function of the
0-based index computed as torch computes the rate after that many ``scheduler.step()``
calls (tested against torch at every index). torch's chainable schedulers update the rate
in place (``lr *= gamma`` at a milestone); ``MultiStep`` repeats those products, so its
bits are torch's. ``optim.step`` and ``optim.exponential`` keep upstream's closed forms
(``base * gamma ** k``), which differ from torch's repeated products in the last bits
(``ExponentialLR``: 4 ulps by its 18th step); ``optim.lr_scheduler`` has torch's classes
with torch's bits.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Optional

from ..errors import ConfigError
from ..validate import check_count, is_int, is_number
from .hyper import check_rate
from .schedules import Schedule


@dataclass(frozen=True)
class OneCycle(Schedule):
    """torch's ``OneCycleLR`` rate (``cycle_momentum`` aside: leantrain schedules the rate
    only): from ``max_lr / div_factor`` up to ``max_lr`` over ``pct_start`` of the run, then
    down to ``initial / final_div_factor`` (``three_phase``: back to the initial rate first)."""

    constructor: ClassVar[str] = "one_cycle"

    max_lr: float
    total_steps: int
    pct_start: float = 0.3
    anneal: str = "cos"
    div_factor: float = 25.0
    final_div_factor: float = 1e4
    three_phase: bool = False

    def __post_init__(self) -> None:
        op = "optim.one_cycle"
        object.__setattr__(self, "max_lr", check_rate(op, "max_lr", self.max_lr))
        check_count(op, "total_steps", self.total_steps, 1)
        if not (is_number(self.pct_start) and 0.0 <= self.pct_start <= 1.0):
            raise ConfigError(f"{op}: pct_start must be in [0, 1], got {self.pct_start!r}")
        if self.anneal not in ("cos", "linear"):
            raise ConfigError(f"{op}: anneal must be 'cos' or 'linear', got {self.anneal!r}")
        for name in ("div_factor", "final_div_factor"):
            v = getattr(self, name)
            if not (is_number(v) and math.isfinite(v) and v > 0):
                raise ConfigError(f"{op}: {name} must be a finite number > 0, got {v!r}")

    def _phases(self) -> list[tuple[float, float, float]]:
        initial = self.max_lr / self.div_factor
        low = initial / self.final_div_factor
        n, p = self.total_steps, float(self.pct_start)
        if self.three_phase:
            return [(float(p * n) - 1, initial, self.max_lr), (float(2 * p * n) - 2, self.max_lr, initial),
                    (n - 1, initial, low)]
        return [(float(p * n) - 1, initial, self.max_lr), (n - 1, self.max_lr, low)]

    def lr_at(self, t: int) -> float:
        t = min(t, self.total_steps)  # torch refuses to step past the end; the last rate holds here
        start = 0.0
        phases = self._phases()
        for i, (end, a, b) in enumerate(phases):
            if t <= end or i == len(phases) - 1:
                pct = (t - start) / (end - start)
                if self.anneal == "cos":
                    return b + (a - b) / 2.0 * (math.cos(math.pi * pct) + 1)
                return (b - a) * pct + a
            start = end
        raise AssertionError("unreachable")

    def max_rate(self) -> float:
        return self.max_lr


@dataclass(frozen=True)
class CosineRestarts(Schedule):
    """torch's ``CosineAnnealingWarmRestarts``: ``eta_min + (base - eta_min) * (1 +
    cos(pi * t_cur / t_i)) / 2``, restarting after ``t_0`` indices, each period ``t_mult``
    times the last."""

    constructor: ClassVar[str] = "cosine_restarts"

    base: float
    t_0: int
    t_mult: int = 1
    eta_min: float = 0.0

    def __post_init__(self) -> None:
        op = "optim.cosine_restarts"
        object.__setattr__(self, "base", check_rate(op, "base", self.base))
        object.__setattr__(self, "eta_min", check_rate(op, "eta_min", self.eta_min))
        check_count(op, "t_0", self.t_0, 1)
        check_count(op, "t_mult", self.t_mult, 1)

    def lr_at(self, t: int) -> float:
        t_cur, t_i = t, self.t_0  # torch's counters after t steps, advanced as its step() does
        if self.t_mult == 1:
            t_cur = t % self.t_0
        else:
            while t_cur >= t_i:
                t_cur, t_i = t_cur - t_i, t_i * self.t_mult
        return self.eta_min + (self.base - self.eta_min) * (1 + math.cos(math.pi * t_cur / t_i)) / 2

    def max_rate(self) -> float:
        return max(self.base, self.eta_min)


@dataclass(frozen=True)
class MultiStep(Schedule):
    """torch's ``MultiStepLR``: the rate multiplied by ``gamma`` at each milestone (a
    milestone listed twice multiplies by ``gamma**2``), as torch's repeated products."""

    constructor: ClassVar[str] = "multi_step"

    base: float
    milestones: tuple
    gamma: float = 0.1

    def __post_init__(self) -> None:
        op = "optim.multi_step"
        object.__setattr__(self, "base", check_rate(op, "base", self.base))
        if not (isinstance(self.milestones, (list, tuple)) and all(is_int(m) and m >= 0 for m in self.milestones)):
            raise ConfigError(f"{op}: milestones must be a list of integers >= 0, got {self.milestones!r}")
        object.__setattr__(self, "milestones", tuple(sorted(self.milestones)))
        if not (is_number(self.gamma) and 0.0 <= self.gamma <= 1.0):
            raise ConfigError(f"{op}: gamma must be in [0, 1], got {self.gamma!r}")

    def lr_at(self, t: int) -> float:
        lr = self.base
        passed = self.milestones[:bisect.bisect_right(self.milestones, t)]
        for m in sorted(set(passed)):
            lr = lr * self.gamma ** passed.count(m)
        return lr

    def max_rate(self) -> float:
        return self.base


def refuse_plateau(op: str, schedules) -> None:
    """A plateau schedule is fed evaluations by the loop, as the run's schedule; inside a
    composition it would never be fed (torch's SequentialLR and ChainedScheduler refuse it)."""
    for k, s in enumerate(schedules):
        if getattr(s, "fed_by_evaluations", False):
            raise ConfigError(f"{op}: schedules[{k}] is a plateau schedule, which the loop feeds with evaluations "
                              f"only as the run's own scheduler (torch's SequentialLR and ChainedScheduler refuse "
                              f"ReduceLROnPlateau too); give it as the scheduler itself")


@dataclass(frozen=True)
class Sequential(Schedule):
    """torch's ``SequentialLR``: ``schedules[k]`` from ``milestones[k-1]`` on, each
    starting from its own index 0 there."""

    constructor: ClassVar[str] = "sequential"

    schedules: tuple
    milestones: tuple

    def __post_init__(self) -> None:
        op = "optim.sequential"
        if not (isinstance(self.schedules, (list, tuple)) and self.schedules
                and all(isinstance(s, Schedule) for s in self.schedules)):
            raise ConfigError(f"{op}: schedules must be a non-empty list of leantrain schedules")
        refuse_plateau(op, self.schedules)
        for k, part in enumerate(self.schedules):
            if hasattr(part, "torch_name"):
                raise ConfigError(f"{op}: schedules[{k}] is torch's {part.torch_name}, whose rate carries over at a "
                                  f"milestone as in torch: compose it with lr_scheduler.SequentialLR")
        ms = self.milestones
        if not (isinstance(ms, (list, tuple)) and len(ms) == len(self.schedules) - 1
                and all(is_int(m) and m >= 0 for m in ms) and list(ms) == sorted(ms)):
            raise ConfigError(f"{op}: milestones must be {len(self.schedules) - 1} increasing integers >= 0, got "
                              f"{ms!r}")
        object.__setattr__(self, "schedules", tuple(self.schedules))
        object.__setattr__(self, "milestones", tuple(ms))

    def lr_at(self, t: int) -> float:
        k = bisect.bisect_right(self.milestones, t)
        return self.schedules[k].lr_at(t - (self.milestones[k - 1] if k else 0))

    def max_rate(self) -> Optional[float]:
        rates = [s.max_rate() for s in self.schedules]
        return None if any(r is None for r in rates) else max(rates)


@dataclass(frozen=True)
class Lambda(Schedule):
    """torch's ``LambdaLR``: ``base * fn(t)``, ``fn`` the user's function of the index (it
    must depend on the index alone, so a resumed run gets the same rates)."""

    constructor: ClassVar[str] = "lambda_schedule"

    base: float
    fn: Callable[[int], float] = field(compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "base", check_rate("optim.lambda_schedule", "base", self.base))
        if not callable(self.fn):
            raise ConfigError(f"optim.lambda_schedule: fn must be a function of the index, got {type(self.fn).__name__}")

    def lr_at(self, t: int) -> float:
        value = self.base * self.fn(t)
        if not (is_number(value) and math.isfinite(value) and value >= 0):
            raise ConfigError(f"optim.lambda_schedule: base * fn({t}) = {value!r}; a rate must be finite and >= 0")
        return float(value)
