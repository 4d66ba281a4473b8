"""torch's schedulers that multiply the rate by a factor: ``LambdaLR``, ``MultiplicativeLR``,
``StepLR``, ``MultiStepLR``, ``ConstantLR``, ``LinearLR``, ``ExponentialLR``,
``PolynomialLR``. Each follows its torch class's arithmetic in torch's order (most from
the group's current rate, in place: ``replay.py``), so its rates are torch's, bit for bit.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Callable, Union

from ....errors import ConfigError
from ....validate import check_count, is_int, is_number
from .replay import LRScheduler, Run, current, per_group

Lambda = Union[Callable[[int], float], list]


def _factor(op: str, name: str, value, low: float, high: float, low_open: bool = False) -> float:
    if not (is_number(value) and (low < value if low_open else low <= value) and value <= high):
        raise ConfigError(f"{op}: {name} must be in {'(' if low_open else '['}{low}, {high}], got {value!r}")
    return value


def _functions(op: str, lr_lambda, groups: int) -> list:
    """One function of the index per group (torch's ``lr_lambda``: one for all, or a list)."""
    fns = per_group(op, "lr_lambda", lr_lambda, groups)
    if not all(callable(f) for f in fns):
        raise ConfigError(f"{op}: lr_lambda must be a function of the index (or a list of them)")
    return fns


class LambdaLR(LRScheduler):
    """``base_lr * lr_lambda(epoch)`` per group (one function, or a list: one per group)."""

    torch_name = "LambdaLR"

    def __init__(self, optimizer, lr_lambda: Lambda, last_epoch: int = -1) -> None:
        super().__init__(optimizer, last_epoch)
        self.lr_lambdas = _functions(self.op, lr_lambda, self.groups)

    peak_factor = None  #: the largest factor, where known (transformers' schedules set it)

    def get_lr(self, run: Run) -> list:
        return [base * fn(run.last_epoch) for fn, base in zip(self.lr_lambdas, run.base_lrs)]

    def max_rate(self):
        return None if self.peak_factor is None else max(self.bases) * self.peak_factor

    def lr_at(self, t: int) -> float:
        value = super().lr_at(t)
        if not (is_number(value) and math.isfinite(value) and value >= 0):
            raise ConfigError(f"{self.op}: the rate at index {t}, base * fn({t}) (lr_lambda), is {value!r}; a rate "
                              f"must be finite and >= 0")
        return value


class MultiplicativeLR(LRScheduler):
    """The group's rate times ``lr_lambda(epoch)`` at each step after the first."""

    torch_name = "MultiplicativeLR"

    def __init__(self, optimizer, lr_lambda: Lambda, last_epoch: int = -1) -> None:
        super().__init__(optimizer, last_epoch)
        self.lr_lambdas = _functions(self.op, lr_lambda, self.groups)

    def get_lr(self, run: Run) -> list:
        if run.initial:
            return current(run)
        return [g["lr"] * self._factor_at(fn, run.last_epoch) for fn, g in zip(self.lr_lambdas, run.groups)]

    def _factor_at(self, fn, t: int) -> float:
        value = fn(t)
        if not is_number(value):
            raise ConfigError(f"{self.op}: lr_lambda({t}) must return a number (the factor), got {value!r:.60}")
        return value


class StepLR(LRScheduler):
    """The rate times ``gamma`` every ``step_size`` steps (in place, as torch's)."""

    torch_name = "StepLR"

    def __init__(self, optimizer, step_size: int, gamma: float = 0.1, last_epoch: int = -1) -> None:
        super().__init__(optimizer, last_epoch)
        self.step_size = check_count(self.op, "step_size", step_size, 1)
        self.gamma = _factor(self.op, "gamma", gamma, 0.0, 1.0)

    def get_lr(self, run: Run) -> list:
        if run.last_epoch == 0 or run.last_epoch % self.step_size != 0:
            return current(run)
        return [g["lr"] * self.gamma for g in run.groups]

    def closed_form(self, run: Run) -> list:
        return [base * self.gamma ** (run.last_epoch // self.step_size) for base in run.base_lrs]


class MultiStepLR(LRScheduler):
    """The rate times ``gamma`` at each milestone (a milestone listed k times: ``gamma**k``)."""

    torch_name = "MultiStepLR"

    def __init__(self, optimizer, milestones, gamma: float = 0.1, last_epoch: int = -1) -> None:
        super().__init__(optimizer, last_epoch)
        if isinstance(milestones, (str, bytes)) or not hasattr(milestones, "__iter__"):
            raise ConfigError(f"{self.op}: milestones must be a list of integers >= 0, got {milestones!r}")
        milestones = list(milestones)
        if not all(is_int(m) and m >= 0 for m in milestones):
            raise ConfigError(f"{self.op}: milestones must be a list of integers >= 0, got {milestones!r}")
        self.milestones = Counter(milestones)
        self.gamma = _factor(self.op, "gamma", gamma, 0.0, 1.0)

    def get_lr(self, run: Run) -> list:
        if run.last_epoch not in self.milestones:
            return current(run)
        return [g["lr"] * self.gamma ** self.milestones[run.last_epoch] for g in run.groups]

    def max_rate(self) -> float:
        return max(self.bases)  # gamma <= 1: the rate never rises

    def closed_form(self, run: Run) -> list:
        from bisect import bisect_right

        passed = bisect_right(sorted(self.milestones.elements()), run.last_epoch)
        return [base * self.gamma ** passed for base in run.base_lrs]


class ConstantLR(LRScheduler):
    """The rate times ``factor`` until ``total_iters``, then back (``1 / factor``)."""

    torch_name = "ConstantLR"

    def __init__(self, optimizer, factor: float = 1.0 / 3, total_iters: int = 5, last_epoch: int = -1) -> None:
        super().__init__(optimizer, last_epoch)
        self.factor = _factor(self.op, "factor", factor, 0.0, 1.0)
        self.total_iters = check_count(self.op, "total_iters", total_iters, 0)

    def get_lr(self, run: Run) -> list:
        if run.last_epoch == 0:
            return [g["lr"] * self.factor for g in run.groups]
        if run.last_epoch != self.total_iters:
            return current(run)
        return [g["lr"] * (1.0 / self.factor) for g in run.groups]

    def closed_form(self, run: Run) -> list:
        return [base * (self.factor + (run.last_epoch >= self.total_iters) * (1 - self.factor))
                for base in run.base_lrs]


class LinearLR(LRScheduler):
    """The rate's factor moving linearly from ``start_factor`` to ``end_factor`` over
    ``total_iters`` steps (torch's in-place recursion)."""

    torch_name = "LinearLR"

    def __init__(self, optimizer, start_factor: float = 1.0 / 3, end_factor: float = 1.0, total_iters: int = 5,
                 last_epoch: int = -1) -> None:
        super().__init__(optimizer, last_epoch)
        self.start_factor = _factor(self.op, "start_factor", start_factor, 0.0, 1.0, low_open=True)
        self.end_factor = _factor(self.op, "end_factor", end_factor, 0.0, 1.0)
        self.total_iters = check_count(self.op, "total_iters", total_iters, 0)

    def get_lr(self, run: Run) -> list:
        if run.last_epoch == 0:
            return [g["lr"] * self.start_factor for g in run.groups]
        if run.initial or run.last_epoch > self.total_iters:
            return current(run)
        step = 1.0 + (self.end_factor - self.start_factor) / (
            self.total_iters * self.start_factor + (run.last_epoch - 1) * (self.end_factor - self.start_factor))
        return [g["lr"] * step for g in run.groups]

    def closed_form(self, run: Run) -> list:
        return [base * (self.start_factor + (self.end_factor - self.start_factor)
                        * min(self.total_iters, run.last_epoch) / self.total_iters) for base in run.base_lrs]


class ExponentialLR(LRScheduler):
    """The rate times ``gamma`` at every step (in place: torch's products, not ``gamma**t``)."""

    torch_name = "ExponentialLR"

    def __init__(self, optimizer, gamma: float, last_epoch: int = -1) -> None:
        super().__init__(optimizer, last_epoch)
        self.gamma = _factor(self.op, "gamma", gamma, 0.0, 1.0)

    def get_lr(self, run: Run) -> list:
        if run.initial:
            return current(run)
        return [g["lr"] * self.gamma for g in run.groups]

    def closed_form(self, run: Run) -> list:
        return [base * self.gamma ** run.last_epoch for base in run.base_lrs]


class PolynomialLR(LRScheduler):
    """The rate decayed as ``(1 - t / total_iters) ** power`` until ``total_iters`` (torch's
    in-place ratio of successive factors)."""

    torch_name = "PolynomialLR"

    def __init__(self, optimizer, total_iters: int = 5, power: float = 1.0, last_epoch: int = -1) -> None:
        super().__init__(optimizer, last_epoch)
        self.total_iters = check_count(self.op, "total_iters", total_iters, 1)
        if not (is_number(power) and power >= 0):  # a negative power grows to 1/0 at total_iters
            raise ConfigError(f"{self.op}: power must be a number >= 0, got {power!r}")
        self.power = power

    def get_lr(self, run: Run) -> list:
        if run.initial or run.last_epoch > self.total_iters:
            return current(run)
        factor = ((1.0 - run.last_epoch / self.total_iters)
                  / (1.0 - (run.last_epoch - 1) / self.total_iters)) ** self.power
        return [g["lr"] * factor for g in run.groups]

    def closed_form(self, run: Run) -> list:
        return [base * (1.0 - min(self.total_iters, run.last_epoch) / self.total_iters) ** self.power
                for base in run.base_lrs]
