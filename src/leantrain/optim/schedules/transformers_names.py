"""transformers' schedule functions by their own names and keywords, and ``get_scheduler``
with every ``SchedulerType`` (Trainer's ``lr_scheduler_type``): each returns the leantrain
schedule with transformers' rates (its factor functions, multiplied into each param
group's rate as its ``LambdaLR`` multiplies them), so a Trainer script's schedule ports as
written::

    schedule = optim.get_scheduler("cosine", opt, num_warmup_steps=100, num_training_steps=1000)

``optimizer`` is the leantrain optimizer (its groups' rates) or a rate.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Optional

from ...errors import ConfigError
from .greedy import Greedy
from .lr_scheduler import LambdaLR, ReduceLROnPlateau
from .lr_scheduler.replay import describe
from .transformers_forms import (
    ConstantWithWarmup, CosineWarmupWithMinLR, CosineWithMinLR, CosineWithWarmup, InverseSqrt, Linear, Polynomial,
    WarmupStableDecay,
)


def _lambda(optimizer, schedule, last_epoch: int) -> LambdaLR:
    """transformers' ``LambdaLR(optimizer, factor, last_epoch)`` with ``schedule``'s factor."""
    plan = LambdaLR(optimizer, schedule._factor, last_epoch)
    plan.peak_factor = schedule.max_rate() / schedule.base if schedule.base else 1.0
    return plan


def _first_rate(optimizer) -> float:
    return describe(optimizer)[0][0]


def get_constant_schedule(optimizer, last_epoch: int = -1) -> LambdaLR:
    """The optimizer's rate at every step."""
    return LambdaLR(optimizer, _one, last_epoch)


def _one(_t: int) -> float:
    return 1


def get_constant_schedule_with_warmup(optimizer, num_warmup_steps: int, last_epoch: int = -1) -> LambdaLR:
    """0 up to the optimizer's rate over the warm-up, then that rate."""
    return _lambda(optimizer, ConstantWithWarmup(1.0, num_warmup_steps), last_epoch)


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps: int, num_training_steps: int,
                                    last_epoch: int = -1) -> LambdaLR:
    """0 up to the rate over the warm-up, then down to 0 at ``num_training_steps``."""
    return _lambda(optimizer, Linear(1.0, num_warmup_steps, num_training_steps), last_epoch)


def get_cosine_schedule_with_warmup(optimizer, num_warmup_steps: int, num_training_steps: int,
                                    num_cycles: float = 0.5, last_epoch: int = -1) -> LambdaLR:
    """Warm-up, then a cosine to 0 (``num_cycles`` waves; half a wave by default)."""
    return _lambda(optimizer, CosineWithWarmup(1.0, num_warmup_steps, num_training_steps, num_cycles), last_epoch)


def get_cosine_with_hard_restarts_schedule_with_warmup(optimizer, num_warmup_steps: int, num_training_steps: int,
                                                       num_cycles: int = 1, last_epoch: int = -1) -> LambdaLR:
    """Warm-up, then ``num_cycles`` cosines to 0, each restarting at the rate."""
    return _lambda(optimizer, CosineWithWarmup(1.0, num_warmup_steps, num_training_steps, num_cycles, True),
                   last_epoch)


def get_polynomial_decay_schedule_with_warmup(optimizer, num_warmup_steps: int, num_training_steps: int,
                                              lr_end: float = 1e-7, power: float = 1.0,
                                              last_epoch: int = -1) -> LambdaLR:
    """Warm-up, then a polynomial decay to ``lr_end`` (the optimizer's first rate is the
    decay's top, as transformers reads ``optimizer.defaults["lr"]``)."""
    lr_init = _first_rate(optimizer)
    if not lr_init > lr_end:
        raise ConfigError(f"get_polynomial_decay_schedule_with_warmup: lr_end ({lr_end}) must be smaller than the "
                          f"optimizer's rate ({lr_init})")
    schedule = Polynomial(lr_init, num_warmup_steps, num_training_steps, lr_end, power)

    def factor(t: int) -> float:
        return schedule._factor(t)

    plan = LambdaLR(optimizer, factor, last_epoch)
    plan.peak_factor = 1.0
    return plan


def get_inverse_sqrt_schedule(optimizer, num_warmup_steps: int, timescale: Optional[int] = None,
                              last_epoch: int = -1) -> LambdaLR:
    """Warm-up, then the rate over ``sqrt((t + timescale - warm-up) / timescale)``."""
    return _lambda(optimizer, InverseSqrt(1.0, num_warmup_steps, timescale), last_epoch)


def _min_lr_rate(op: str, optimizer, min_lr, min_lr_rate) -> float:
    if min_lr is not None and min_lr_rate is not None:
        raise ConfigError(f"{op}: give min_lr or min_lr_rate, not both")
    if min_lr is not None:
        return min_lr / _first_rate(optimizer)
    if min_lr_rate is None:
        raise ConfigError(f"{op}: give min_lr or min_lr_rate (Trainer: in lr_scheduler_kwargs)")
    return min_lr_rate


def get_cosine_with_min_lr_schedule_with_warmup(optimizer, num_warmup_steps: int, num_training_steps: int,
                                                num_cycles: float = 0.5, last_epoch: int = -1,
                                                min_lr: Optional[float] = None,
                                                min_lr_rate: Optional[float] = None) -> LambdaLR:
    """Warm-up, then a cosine down to ``min_lr`` (or ``min_lr_rate`` times the rate)."""
    rate = _min_lr_rate("get_cosine_with_min_lr_schedule_with_warmup", optimizer, min_lr, min_lr_rate)
    return _lambda(optimizer, CosineWithMinLR(1.0, num_warmup_steps, num_training_steps, num_cycles, rate),
                   last_epoch)


def get_cosine_with_min_lr_schedule_with_warmup_lr_rate(optimizer, num_warmup_steps: int, num_training_steps: int,
                                                        num_cycles: float = 0.5, last_epoch: int = -1,
                                                        min_lr: Optional[float] = None,
                                                        min_lr_rate: Optional[float] = None,
                                                        warmup_lr_rate: Optional[float] = None) -> LambdaLR:
    """A warm-up from ``warmup_lr_rate`` of the rate, then a cosine to ``min_lr``."""
    rate = _min_lr_rate("get_cosine_with_min_lr_schedule_with_warmup_lr_rate", optimizer, min_lr, min_lr_rate)
    return _lambda(optimizer, CosineWarmupWithMinLR(1.0, num_warmup_steps, num_training_steps, num_cycles, rate,
                                                    warmup_lr_rate), last_epoch)


def get_wsd_schedule(optimizer, num_warmup_steps: int, num_decay_steps: int, num_training_steps: Optional[int] = None,
                     num_stable_steps: Optional[int] = None, warmup_type: str = "linear", decay_type: str = "cosine",
                     min_lr_ratio: float = 0, num_cycles: float = 0.5, last_epoch: int = -1) -> LambdaLR:
    """Warm-up, a stable phase, a decay to ``min_lr_ratio`` of the rate."""
    if num_training_steps is None and num_stable_steps is None:
        raise ConfigError("get_wsd_schedule: give num_training_steps or num_stable_steps")
    if num_stable_steps is None:
        num_stable_steps = num_training_steps - num_warmup_steps - num_decay_steps
    return _lambda(optimizer, WarmupStableDecay(1.0, num_warmup_steps, num_stable_steps, num_decay_steps,
                                                min_lr_ratio, warmup_type, decay_type, num_cycles), last_epoch)


def get_reduce_on_plateau_schedule(optimizer, **kwargs) -> ReduceLROnPlateau:
    """torch's ``ReduceLROnPlateau`` (fed by the loop's evaluations)."""
    return ReduceLROnPlateau(optimizer, **kwargs)


def get_greedy_schedule(optimizer, **kwargs) -> Greedy:
    """transformers' ``GreedyLR`` (fed by the loop's evaluations)."""
    kwargs.pop("verbose", None)  # transformers prints each change; the loop logs the rate
    return Greedy(optimizer, **kwargs)


#: Trainer's ``lr_scheduler_type`` names (transformers' ``SchedulerType``) -> the function above
SCHEDULER_TYPES = {
    "linear": get_linear_schedule_with_warmup,
    "cosine": get_cosine_schedule_with_warmup,
    "cosine_with_restarts": get_cosine_with_hard_restarts_schedule_with_warmup,
    "polynomial": get_polynomial_decay_schedule_with_warmup,
    "constant": get_constant_schedule,
    "constant_with_warmup": get_constant_schedule_with_warmup,
    "inverse_sqrt": get_inverse_sqrt_schedule,
    "reduce_lr_on_plateau": get_reduce_on_plateau_schedule,
    "cosine_with_min_lr": get_cosine_with_min_lr_schedule_with_warmup,
    "cosine_warmup_with_min_lr": get_cosine_with_min_lr_schedule_with_warmup_lr_rate,
    "warmup_stable_decay": get_wsd_schedule,
    "greedy": get_greedy_schedule,
}


def warmup_steps_for(op: str, num_training_steps: int, warmup_steps=0, warmup_ratio: Optional[float] = None) -> int:
    """Trainer's warm-up length: ``warmup_steps`` when >= 1, else a ratio of the run
    (``ceil(num_training_steps * ratio)``; ``warmup_ratio`` names the ratio outright)."""
    if warmup_ratio is not None:
        if warmup_steps:
            raise ConfigError(f"{op}: give warmup_steps or warmup_ratio, not both")
        warmup_steps = warmup_ratio
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, (int, float)) or warmup_steps < 0:
        raise ConfigError(f"{op}: warmup must be a step count >= 1 or a ratio in [0, 1), got {warmup_steps!r}")
    if warmup_steps >= 1:
        if warmup_steps != int(warmup_steps):
            raise ConfigError(f"{op}: a warm-up of {warmup_steps!r} steps: give a whole count, or a ratio below 1")
        return int(warmup_steps)
    return math.ceil(num_training_steps * warmup_steps)


def get_scheduler(name, optimizer, num_warmup_steps: Optional[int] = None, num_training_steps: Optional[int] = None,
                  scheduler_specific_kwargs: Optional[dict] = None):
    """transformers' ``get_scheduler``: the schedule Trainer builds for ``lr_scheduler_type=name``."""
    name = getattr(name, "value", name)
    if not isinstance(name, str) or name not in SCHEDULER_TYPES:
        raise ConfigError(f"get_scheduler: {name!r:.60} is not one of transformers' scheduler types "
                          f"({', '.join(SCHEDULER_TYPES)})")
    fn = SCHEDULER_TYPES[name]
    if scheduler_specific_kwargs is not None and not (
            isinstance(scheduler_specific_kwargs, Mapping) and all(isinstance(k, str) for k in scheduler_specific_kwargs)):
        raise ConfigError(f"get_scheduler: scheduler_specific_kwargs must be a dict of keyword arguments, got "
                          f"{type(scheduler_specific_kwargs).__name__}")
    kwargs = dict(scheduler_specific_kwargs or {})
    params = inspect.signature(fn).parameters
    own = [p for p in params if p not in ("optimizer", "num_warmup_steps", "num_training_steps")]
    unknown = sorted(k for k in kwargs if k not in own)
    if unknown and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        raise ConfigError(f"get_scheduler: {name} takes no keyword {', '.join(map(repr, unknown))} in "
                          f"scheduler_specific_kwargs (it takes {', '.join(own) or 'none'})")
    if name == "constant":
        return fn(optimizer)
    if name in ("reduce_lr_on_plateau", "greedy"):
        return fn(optimizer, **kwargs)
    if num_warmup_steps is None:
        raise ConfigError(f"get_scheduler: {name} needs num_warmup_steps")
    if name == "constant_with_warmup":
        return fn(optimizer, num_warmup_steps=num_warmup_steps)
    if name == "inverse_sqrt":
        return fn(optimizer, num_warmup_steps=num_warmup_steps, **kwargs)
    if name == "warmup_stable_decay":
        return fn(optimizer, num_warmup_steps=num_warmup_steps, num_training_steps=num_training_steps, **kwargs)
    if num_training_steps is None:
        raise ConfigError(f"get_scheduler: {name} needs num_training_steps")
    return fn(optimizer, num_warmup_steps=num_warmup_steps, num_training_steps=num_training_steps, **kwargs)


__all__ = ["get_scheduler", "SCHEDULER_TYPES", "warmup_steps_for", *[f.__name__ for f in SCHEDULER_TYPES.values()]]
