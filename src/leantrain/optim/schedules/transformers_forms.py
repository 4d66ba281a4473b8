"""The warm-up schedules of transformers (``get_linear_schedule_with_warmup`` and its
siblings), as leantrain schedules: each ``lr_at(t)`` is ``base * factor(t)`` with the
factor computed as transformers computes it and multiplied as torch's ``LambdaLR``
multiplies it, so the rates are the same binary64 numbers at every update (tested).
Like transformers' the factor at index 0 is 0 during a warm-up: the first update of a
warmed-up run does not move the parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

from ...errors import ConfigError
from ...validate import check_count, is_number
from ..hyper import check_rate
from .upstream import Schedule

SHAPES = ("linear", "cosine", "1-sqrt")


def _warming(t: int, warmup: int) -> float:
    return float(t) / float(max(1, warmup))


class _Factored(Schedule):
    """``base * _factor(t)``, as ``LambdaLR`` multiplies: the base is the largest rate."""

    base: float

    def _factor(self, t: int) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def lr_at(self, t: int) -> float:
        return self.base * self._factor(t)

    def max_rate(self) -> float:
        return self.base


@dataclass(frozen=True)
class Linear(_Factored):
    """Linear warm-up from 0 to ``base`` over ``warmup_steps``, then linear decay to 0 at
    ``total_steps`` (transformers' default schedule)."""

    constructor: ClassVar[str] = "linear"

    base: float
    warmup_steps: int
    total_steps: int

    def __post_init__(self) -> None:
        op = "optim.linear"
        object.__setattr__(self, "base", check_rate(op, "base", self.base))
        check_count(op, "warmup_steps", self.warmup_steps, 0)
        check_count(op, "total_steps", self.total_steps, 0)

    def _factor(self, t: int) -> float:
        if t < self.warmup_steps:
            return _warming(t, self.warmup_steps)
        return max(0.0, float(self.total_steps - t) / float(max(1, self.total_steps - self.warmup_steps)))


@dataclass(frozen=True)
class CosineWithWarmup(_Factored):
    """transformers' cosine: linear warm-up, then ``0.5 * (1 + cos(pi * 2 * cycles * progress))``
    of ``base``; ``restarts=True``: hard restarts, ``cycles`` of them (its
    ``get_cosine_with_hard_restarts_schedule_with_warmup``)."""

    constructor: ClassVar[str] = "cosine_with_warmup"

    base: float
    warmup_steps: int
    total_steps: int
    cycles: Optional[float] = None  # transformers' defaults: 0.5 (half a cosine), 1 with restarts
    restarts: bool = False

    def __post_init__(self) -> None:
        op = "optim.cosine_with_warmup"
        if self.cycles is None:
            object.__setattr__(self, "cycles", 1 if self.restarts else 0.5)
        object.__setattr__(self, "base", check_rate(op, "base", self.base))
        check_count(op, "warmup_steps", self.warmup_steps, 0)
        check_count(op, "total_steps", self.total_steps, 0)
        if not (is_number(self.cycles) and math.isfinite(self.cycles) and self.cycles >= 0):
            raise ConfigError(f"{op}: cycles must be a finite number >= 0, got {self.cycles!r}")

    def _factor(self, t: int) -> float:
        if t < self.warmup_steps:
            return _warming(t, self.warmup_steps)
        progress = float(t - self.warmup_steps) / float(max(1, self.total_steps - self.warmup_steps))
        if self.restarts:
            if progress >= 1.0:
                return 0.0
            return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(self.cycles) * progress) % 1.0))))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(self.cycles) * 2.0 * progress)))


@dataclass(frozen=True)
class WarmupStableDecay(_Factored):
    """Warm-up, a stable phase at ``base``, then a decay to ``min_ratio * base``
    (transformers' ``get_wsd_schedule``; ``warmup_shape``/``decay_shape``: linear, cosine
    or 1-sqrt)."""

    constructor: ClassVar[str] = "warmup_stable_decay"

    base: float
    warmup_steps: int
    stable_steps: int
    decay_steps: int
    min_ratio: float = 0.0
    warmup_shape: str = "linear"
    decay_shape: str = "cosine"
    cycles: float = 0.5

    def __post_init__(self) -> None:
        op = "optim.warmup_stable_decay"
        object.__setattr__(self, "base", check_rate(op, "base", self.base))
        for name in ("warmup_steps", "stable_steps", "decay_steps"):
            check_count(op, name, getattr(self, name), 0)
        if not (is_number(self.min_ratio) and 0.0 <= self.min_ratio <= 1.0):
            raise ConfigError(f"{op}: min_ratio must be in [0, 1], got {self.min_ratio!r}")
        for name in ("warmup_shape", "decay_shape"):
            if getattr(self, name) not in SHAPES:
                raise ConfigError(f"{op}: {name} must be one of {SHAPES}, got {getattr(self, name)!r}")

    def _factor(self, t: int) -> float:
        w, s, d, lo = self.warmup_steps, self.stable_steps, self.decay_steps, self.min_ratio
        if t < w:
            progress = _warming(t, w)
            f = {"linear": lambda: progress, "cosine": lambda: 0.5 * (1.0 - math.cos(math.pi * progress)),
                 "1-sqrt": lambda: 1.0 - math.sqrt(1.0 - progress)}[self.warmup_shape]()
            return max(0.0, f * (1.0 - lo) + lo)
        if t < w + s:
            return 1.0
        if t < w + s + d:
            progress = float(t - w - s) / float(max(1, d))
            f = {"linear": lambda: 1.0 - progress,
                 "cosine": lambda: 0.5 * (1.0 + math.cos(math.pi * float(self.cycles) * 2.0 * progress)),
                 "1-sqrt": lambda: 1.0 - math.sqrt(progress)}[self.decay_shape]()
            return max(0.0, f * (1.0 - lo) + lo)
        return lo


@dataclass(frozen=True)
class Polynomial(_Factored):
    """Linear warm-up, then ``(base - end) * (1 - progress)**power + end``, then ``end``
    after ``total_steps`` (transformers' ``get_polynomial_decay_schedule_with_warmup``)."""

    constructor: ClassVar[str] = "polynomial"

    base: float
    warmup_steps: int
    total_steps: int
    end: float = 1e-7
    power: float = 1.0

    def __post_init__(self) -> None:
        op = "optim.polynomial"
        object.__setattr__(self, "base", check_rate(op, "base", self.base))
        object.__setattr__(self, "end", check_rate(op, "end", self.end))
        check_count(op, "warmup_steps", self.warmup_steps, 0)
        check_count(op, "total_steps", self.total_steps, 0)
        if not self.base > self.end:
            raise ConfigError(f"{op}: end ({self.end!r}) must be below base ({self.base!r})")
        if not (is_number(self.power) and math.isfinite(self.power) and self.power >= 0):
            raise ConfigError(f"{op}: power must be a finite number >= 0, got {self.power!r}")
        if self.total_steps <= self.warmup_steps:
            raise ConfigError(f"{op}: total_steps ({self.total_steps}) must exceed warmup_steps ({self.warmup_steps})")

    def _factor(self, t: int) -> float:
        if t < self.warmup_steps:
            return _warming(t, self.warmup_steps)
        if t > self.total_steps:
            return self.end / self.base
        remaining = 1 - (t - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        return ((self.base - self.end) * remaining ** self.power + self.end) / self.base


@dataclass(frozen=True)
class InverseSqrt(_Factored):
    """Linear warm-up, then ``base / sqrt((t + timescale - warmup) / timescale)``
    (transformers' ``get_inverse_sqrt_schedule``; ``timescale`` defaults to the warm-up, or
    10000 without one)."""

    constructor: ClassVar[str] = "inverse_sqrt"

    base: float
    warmup_steps: int
    timescale: Optional[int] = None

    def __post_init__(self) -> None:
        op = "optim.inverse_sqrt"
        object.__setattr__(self, "base", check_rate(op, "base", self.base))
        check_count(op, "warmup_steps", self.warmup_steps, 0)
        if self.timescale is None:
            object.__setattr__(self, "timescale", self.warmup_steps or 10_000)
        check_count(op, "timescale", self.timescale, 1)

    def _factor(self, t: int) -> float:
        if t < self.warmup_steps:
            return _warming(t, self.warmup_steps)
        return 1.0 / math.sqrt((t + (self.timescale - self.warmup_steps)) / self.timescale)

    def max_rate(self) -> float:
        return self.base * max(1.0, self._factor(self.warmup_steps))


@dataclass(frozen=True)
class ConstantWithWarmup(_Factored):
    """Linear warm-up from 0 to ``base`` over ``warmup_steps``, then ``base``
    (transformers' ``get_constant_schedule_with_warmup``)."""

    constructor: ClassVar[str] = "constant_with_warmup"

    base: float
    warmup_steps: int

    def __post_init__(self) -> None:
        op = "optim.constant_with_warmup"
        object.__setattr__(self, "base", check_rate(op, "base", self.base))
        check_count(op, "warmup_steps", self.warmup_steps, 0)

    def _factor(self, t: int) -> float:
        if t < self.warmup_steps:
            return float(t) / float(max(1.0, self.warmup_steps))
        return 1.0


def _check_ratio(op: str, name: str, value) -> float:
    if not (is_number(value) and 0.0 <= value <= 1.0):
        raise ConfigError(f"{op}: {name} must be in [0, 1], got {value!r}")
    return value


@dataclass(frozen=True)
class CosineWithMinLR(_Factored):
    """transformers' ``get_cosine_with_min_lr_schedule_with_warmup``: the cosine of
    ``cosine_with_warmup`` lifted to end at ``min_lr_rate * base``."""

    constructor: ClassVar[str] = "cosine_with_min_lr"

    base: float
    warmup_steps: int
    total_steps: int
    cycles: float = 0.5
    min_lr_rate: float = 0.0

    def __post_init__(self) -> None:
        op = "optim.cosine_with_min_lr"
        object.__setattr__(self, "base", check_rate(op, "base", self.base))
        check_count(op, "warmup_steps", self.warmup_steps, 0)
        check_count(op, "total_steps", self.total_steps, 0)
        _check_ratio(op, "min_lr_rate", self.min_lr_rate)
        if not (is_number(self.cycles) and math.isfinite(self.cycles) and self.cycles >= 0):
            raise ConfigError(f"{op}: cycles must be a finite number >= 0, got {self.cycles!r}")

    def _factor(self, t: int) -> float:
        if t < self.warmup_steps:
            return float(t) / float(max(1, self.warmup_steps))
        progress = float(t - self.warmup_steps) / float(max(1, self.total_steps - self.warmup_steps))
        factor = 0.5 * (1.0 + math.cos(math.pi * float(self.cycles) * 2.0 * progress))
        factor = factor * (1 - self.min_lr_rate) + self.min_lr_rate
        return max(0, factor)


@dataclass(frozen=True)
class CosineWarmupWithMinLR(_Factored):
    """transformers' ``get_cosine_with_min_lr_schedule_with_warmup_lr_rate``: a warm-up
    from ``warmup_lr_rate * base`` (default ``1 / warmup_steps``) that reaches ``base`` at
    its last step, then the cosine to ``min_lr_rate * base``, one step ahead of
    ``cosine_with_min_lr``'s."""

    constructor: ClassVar[str] = "cosine_warmup_with_min_lr"

    base: float
    warmup_steps: int
    total_steps: int
    cycles: float = 0.5
    min_lr_rate: float = 0.0
    warmup_lr_rate: Optional[float] = None

    def __post_init__(self) -> None:
        op = "optim.cosine_warmup_with_min_lr"
        object.__setattr__(self, "base", check_rate(op, "base", self.base))
        check_count(op, "warmup_steps", self.warmup_steps, 0)
        check_count(op, "total_steps", self.total_steps, 0)
        _check_ratio(op, "min_lr_rate", self.min_lr_rate)
        if self.warmup_lr_rate is not None:
            _check_ratio(op, "warmup_lr_rate", self.warmup_lr_rate)
        if not (is_number(self.cycles) and math.isfinite(self.cycles) and self.cycles >= 0):
            raise ConfigError(f"{op}: cycles must be a finite number >= 0, got {self.cycles!r}")

    def _factor(self, t: int) -> float:
        step, w, n = float(t), float(self.warmup_steps), float(self.total_steps)
        if step < w:
            if self.warmup_lr_rate is None:
                return (step + 1.0) / max(1.0, w)
            rate = float(self.warmup_lr_rate)
            return rate + (1.0 - rate) * step / (max(1, w - 1))
        progress = (step - w + 1.0) / (max(1.0, n - w))
        factor = 0.5 * (1.0 + math.cos(math.pi * self.cycles * 2.0 * progress))
        factor = factor * (1 - self.min_lr_rate) + self.min_lr_rate
        return max(0, factor)
