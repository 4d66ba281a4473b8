"""Optimizers and learning-rate schedules.

Constructors take the defaults of the TorchLean configs (spec §4)::

    opt = optim.adam(1e-3)
    state = opt.init(params)
    state = opt.step(state, params, grads)
"""

from __future__ import annotations

from .hyper import SGD, Adadelta, Adagrad, Adam, AdamW, Hyper, Lion, RMSProp
from .hyper_torch import ASGD, Adafactor, Adamax, Muon, NAdam, RAdam, Rprop
from .optimizer import OptState, Optimizer
from .porting import from_torch
from .rules import (
    HYPERS,
    AdadeltaState,
    AdagradState,
    AdamState,
    LionState,
    MomentumState,
    RMSPropState,
    SGDState,
)
from .plateau import Plateau, plateau
from .schedules import Constant, Exponential, Schedule, Step, WarmupCosine
from .torch_schedules import Chained, CosineRestarts, Lambda, MultiStep, OneCycle, Sequential
from .warmup_schedules import CosineWithWarmup, InverseSqrt, Linear, Polynomial, WarmupStableDecay


# Every constructor takes ``numerics``: "fast" (the default: torch's kernels) or
# "torchlean" (upstream's per-tensor formulas, one rounding per written operation, on
# the host path; slower; for replaying a run against TorchLean bit for bit), and
# torch.optim's keyword names (``constructors.py``).
from .constructors import (  # noqa: E402
    CONSTRUCTORS, adadelta, adafactor, adagrad, adam, adamax, adamw, asgd, lion, muon, nadam, radam, rmsprop, rprop, sgd,
)


def constant(lr: float) -> Constant:
    """The same rate at every index."""
    return Constant(lr)


def step(base: float, step_size: int, gamma: float = 0.1) -> Step:
    """``base * gamma ** (t // step_size)``: the rate multiplied by ``gamma`` every ``step_size`` indices."""
    return Step(base, step_size, gamma)


def exponential(base: float, gamma: float) -> Exponential:
    """``base * gamma ** t``."""
    return Exponential(base, gamma)


def warmup_cosine(peak: float, min: float, warmup_steps: int, total_steps: int) -> WarmupCosine:
    """A linear warm-up to ``peak`` over ``warmup_steps`` indices, then a cosine decay to ``min`` at
    ``total_steps`` (upstream's newer form: ``peak * ((t + 1) / w)``, cosine of ``pi * ((t - w) / d)``).
    The index is the epoch in the loader loop by default, the update with ``schedule_per="step"``
    and in ``train_samples``.
    """
    return WarmupCosine(peak, min, warmup_steps, total_steps)


def linear(base: float, warmup_steps: int, total_steps: int) -> Linear:
    """transformers' ``get_linear_schedule_with_warmup``: 0 to ``base`` over the warm-up,
    then down to 0 at ``total_steps`` (the same rates at every index)."""
    return Linear(base, warmup_steps, total_steps)


def cosine_with_warmup(base: float, warmup_steps: int, total_steps: int, cycles: float = 0.5, *,
                       restarts: bool = False) -> CosineWithWarmup:
    """transformers' ``get_cosine_schedule_with_warmup`` (``restarts=True``: its hard-restarts
    form, ``cycles`` restarts)."""
    return CosineWithWarmup(base, warmup_steps, total_steps, cycles, restarts)


def warmup_stable_decay(base: float, warmup_steps: int, stable_steps: int, decay_steps: int, *,
                        min_ratio: float = 0.0, warmup_shape: str = "linear", decay_shape: str = "cosine",
                        cycles: float = 0.5) -> WarmupStableDecay:
    """transformers' ``get_wsd_schedule``: warm-up, stable at ``base``, decay to ``min_ratio * base``."""
    return WarmupStableDecay(base, warmup_steps, stable_steps, decay_steps, min_ratio, warmup_shape, decay_shape,
                             cycles)


def polynomial(base: float, warmup_steps: int, total_steps: int, end: float = 1e-7, power: float = 1.0) -> Polynomial:
    """transformers' ``get_polynomial_decay_schedule_with_warmup``."""
    return Polynomial(base, warmup_steps, total_steps, end, power)


def inverse_sqrt(base: float, warmup_steps: int, timescale=None) -> InverseSqrt:
    """transformers' ``get_inverse_sqrt_schedule``."""
    return InverseSqrt(base, warmup_steps, timescale)


def one_cycle(max_lr: float, total_steps: int, pct_start: float = 0.3, anneal: str = "cos", div_factor: float = 25.0,
              final_div_factor: float = 1e4, three_phase: bool = False) -> OneCycle:
    """torch's ``OneCycleLR`` rate (momentum is not cycled)."""
    return OneCycle(max_lr, total_steps, pct_start, anneal, div_factor, final_div_factor, three_phase)


def cosine_restarts(base: float, t_0: int, t_mult: int = 1, eta_min: float = 0.0) -> CosineRestarts:
    """torch's ``CosineAnnealingWarmRestarts``."""
    return CosineRestarts(base, t_0, t_mult, eta_min)


def multi_step(base: float, milestones, gamma: float = 0.1) -> MultiStep:
    """torch's ``MultiStepLR``: the rate times ``gamma`` at each milestone."""
    return MultiStep(base, tuple(milestones) if isinstance(milestones, list) else milestones, gamma)


def sequential(schedules, milestones) -> Sequential:
    """torch's ``SequentialLR``: one schedule after another, each from its index 0."""
    return Sequential(tuple(schedules) if isinstance(schedules, list) else schedules,
                      tuple(milestones) if isinstance(milestones, list) else milestones)


def chained(base: float, schedules) -> Chained:
    """torch's ``ChainedScheduler``: the factors of multiplicative schedules (step,
    exponential, multi-step) applied together to ``base`` (to rounding of torch's rates)."""
    return Chained(base, tuple(schedules) if isinstance(schedules, list) else schedules)


def lambda_schedule(base: float, fn) -> Lambda:
    """torch's ``LambdaLR``: ``base * fn(t)`` for the user's ``fn`` of the index."""
    return Lambda(base, fn)


# Constructors by kind: each registered rule's kinds (see ``rules.RULES``), each
# reached through the constructor of the same name above.
OPTIMIZERS = {kind: CONSTRUCTORS[kind] for kind in HYPERS}

__all__ = [
    "Optimizer", "OptState", "Hyper", "SGD", "Adagrad", "RMSProp", "Adam", "AdamW", "Adadelta", "Lion",
    "SGDState", "MomentumState", "AdagradState", "RMSPropState", "AdamState", "AdadeltaState", "LionState",
    "NAdam", "RAdam", "Adamax", "ASGD", "Rprop", "Adafactor", "Muon", "adafactor",
    "from_torch", "nadam", "radam", "adamax", "asgd", "rprop", "muon",
    "Schedule", "Constant", "Step", "Exponential", "WarmupCosine",
    "sgd", "adagrad", "rmsprop", "adam", "adamw", "adadelta", "lion",
    "constant", "step", "exponential", "warmup_cosine",
    "Linear", "CosineWithWarmup", "WarmupStableDecay", "Polynomial", "InverseSqrt", "OneCycle", "CosineRestarts",
    "MultiStep", "Sequential", "Lambda", "Chained", "chained", "linear", "cosine_with_warmup", "warmup_stable_decay", "polynomial",
    "Plateau", "plateau", "inverse_sqrt", "one_cycle", "cosine_restarts", "multi_step", "sequential", "lambda_schedule", "OPTIMIZERS", "HYPERS",
]
