"""Learning-rate schedules (spec §4): ``lr_at(t)`` for a 0-based index ``t``.

In-memory loops index by optimizer step, loader loops by epoch. A schedule fully
overrides the optimizer's lr, even at ``t = 0``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

from ..errors import ConfigError
from ..validate import check_count, is_number
from .hyper import check_rate


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
