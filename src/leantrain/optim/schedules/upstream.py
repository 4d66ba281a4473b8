"""Learning-rate schedules (spec §4): ``lr_at(t)`` for a 0-based index ``t``. The base
``Schedule``, upstream's forms (``Constant``, ``Step``, ``Exponential``, ``WarmupCosine``)
and ``Sequential``, schedules of any form one after another.

In-memory loops index by optimizer step, loader loops by epoch. A schedule fully
overrides the optimizer's lr, even at ``t = 0``.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import ClassVar, Optional

from ...errors import ConfigError
from ...validate import check_count, is_int, is_number
from ..hyper import check_rate


def _check_count(op: str, name: str, value: object, positive: bool = False) -> int:
    return check_count(op, name, value, 1 if positive else 0)


def _check_factor(op: str, name: str, value: object) -> float:
    if not is_number(value) or not 0.0 <= value <= 1.0:
        raise ConfigError(f"{op}: {name} must be in [0, 1], got {value!r}")
    return float(value)


class Schedule:
    """Base class: a schedule maps a 0-based index to a learning rate.

    A schedule class that sets ``constructor`` gets a function of that name in
    ``leantrain.optim`` taking the class's arguments (``optim/__init__.py`` derives them).
    """

    constructor: ClassVar[Optional[str]] = None

    def lr_at(self, t: int) -> float:  # pragma: no cover - abstract
        """The learning rate at 0-based index ``t`` (an update, or an epoch for the loader
        loop's default)."""
        raise NotImplementedError

    def max_rate(self) -> Optional[float]:
        """The largest rate any index gives (checked against the parameters' dtype before
        training starts), or ``None`` when unknown (a user's own schedule)."""
        return None

    def rates_at(self, t: int) -> tuple[tuple[float, ...], Optional[tuple[float, ...]]]:
        """Each param group's rate at index ``t`` and, where the schedule cycles it, each
        group's momentum (``None``: not cycled). A schedule of one rate gives one: the
        loop scales every group by it as by ``lr_scale``."""
        return (self.lr_at(t),), None


@dataclass(frozen=True)
class Constant(Schedule):
    """``lr`` at every index."""

    constructor: ClassVar[str] = "constant"

    lr: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr", check_rate("optim.constant", "lr", self.lr))

    def lr_at(self, t: int) -> float:
        """``lr`` at every index."""
        return self.lr

    def max_rate(self) -> float:
        return self.lr


@dataclass(frozen=True)
class Step(Schedule):
    """``base * gamma ** (t // step_size)``."""

    constructor: ClassVar[str] = "step"

    base: float
    step_size: int
    gamma: float = 0.1

    def __post_init__(self) -> None:
        object.__setattr__(self, "base", check_rate("optim.step", "base", self.base))
        _check_count("optim.step", "step_size", self.step_size, positive=True)
        object.__setattr__(self, "gamma", _check_factor("optim.step", "gamma", self.gamma))

    def lr_at(self, t: int) -> float:
        """``base * gamma ** (t // step_size)``."""
        return self.base * self.gamma ** (t // self.step_size)

    def max_rate(self) -> float:
        return self.base  # gamma <= 1: index 0 is the largest


@dataclass(frozen=True)
class Exponential(Schedule):
    """``base * gamma ** t`` (binary64 power)."""

    constructor: ClassVar[str] = "exponential"

    base: float
    gamma: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "base", check_rate("optim.exponential", "base", self.base))
        object.__setattr__(self, "gamma", _check_factor("optim.exponential", "gamma", self.gamma))

    def lr_at(self, t: int) -> float:
        """``base * gamma ** t``."""
        return self.base * self.gamma**t

    def max_rate(self) -> float:
        return self.base  # gamma <= 1: index 0 is the largest


@dataclass(frozen=True)
class WarmupCosine(Schedule):
    """Linear warm-up to ``peak`` over ``warmup_steps``, then cosine decay to ``min``."""

    constructor: ClassVar[str] = "warmup_cosine"

    peak: float
    min: float
    warmup_steps: int
    total_steps: int

    def __post_init__(self) -> None:
        op = "optim.warmup_cosine"
        object.__setattr__(self, "peak", check_rate(op, "peak", self.peak))
        object.__setattr__(self, "min", check_rate(op, "min", self.min))
        _check_count(op, "warmup_steps", self.warmup_steps)
        _check_count(op, "total_steps", self.total_steps)
        if self.min > self.peak:
            raise ConfigError(f"{op}: min must be <= peak, got min={self.min!r} > peak={self.peak!r}")

    def lr_at(self, t: int) -> float:
        """``peak * (t + 1) / w`` during the warm-up, then ``min + (peak - min) * (1 + cos(pi * (t - w) / d)) / 2``,
        then ``min`` from ``total_steps`` on (``w`` the warm-up, ``d`` the decay's length).
        """
        if self.total_steps == 0 or t >= self.total_steps:
            return self.min
        w = min(self.warmup_steps, self.total_steps)
        if t < w:
            return self.peak * ((t + 1) / w)  # upstream's newer form: the ratio first
        d = self.total_steps - w
        if d == 0:
            return self.min
        return self.min + (self.peak - self.min) * (1 + math.cos(math.pi * ((t - w) / d))) / 2

    def max_rate(self) -> float:
        return self.peak  # warm-up reaches peak at most; the cosine stays between min and peak


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
    """``schedules[k]`` from ``milestones[k-1]`` on, each starting from its own index 0
    there: torch's ``SequentialLR`` of closed forms (a torch scheduler made from a rate,
    ``optim.multi_step``..., is one; one made with an optimizer carries its rate over
    in torch: ``lr_scheduler.SequentialLR``)."""

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
            if hasattr(part, "torch_name") and not part.on_rate:
                raise ConfigError(f"{op}: schedules[{k}] is torch's {part.torch_name} made with an optimizer, whose "
                                  f"rate carries over at a milestone as in torch: compose it with "
                                  f"lr_scheduler.SequentialLR")
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
