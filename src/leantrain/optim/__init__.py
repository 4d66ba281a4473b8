"""Optimizers and learning-rate schedules.

Constructors take the defaults of the TorchLean configs (spec §4)::

    opt = optim.adam(1e-3)
    state = opt.init(params)
    state = opt.step(state, params, grads)
"""

from __future__ import annotations

from .hyper import SGD, Adadelta, Adagrad, Adam, AdamW, Hyper, Lion, RMSProp
from .optimizer import OptState, Optimizer
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
from .schedules import Constant, Exponential, Schedule, Step, WarmupCosine


# Every constructor takes ``numerics``: "fast" (the default: leantrain's fused order) or
# "torchlean" (upstream's per-tensor formulas, one rounding per written operation, on
# the host path; slower; for replaying a run against TorchLean bit for bit).


def sgd(lr: float, momentum: float = 0.0, *, numerics: str = "fast") -> Optimizer:
    """SGD; plain when ``momentum`` is exactly 0, else heavy-ball momentum (no dampening)."""
    return Optimizer(SGD(lr, momentum, numerics=numerics))


def adagrad(lr: float, eps: float = 1e-10, *, numerics: str = "fast") -> Optimizer:
    """Adagrad: ``s += g*g; p -= lr * g / (sqrt(s) + eps)`` (torch's fused kernel; sparse gradients too).

    Args:
        lr: the learning rate (finite, >= 0).
        eps: added to the root in the denominator.
        numerics: ``"fast"`` (torch's kernels) or ``"torchlean"`` (upstream's formulas, host path).

    Raises:
        ConfigError: a hyperparameter out of its range.
    """
    return Optimizer(Adagrad(lr, eps, numerics=numerics))


def rmsprop(lr: float, decay: float = 0.99, eps: float = 1e-8, *, numerics: str = "fast") -> Optimizer:
    """RMSProp: ``s = decay*s + (1-decay)*g*g; p -= lr * g / (sqrt(s) + eps)`` (torch's foreach kernels).

    Args:
        lr: the learning rate.
        decay: the averaging factor of the squared gradients (torch's ``alpha``).
        eps: added to the root in the denominator.
        numerics: ``"fast"`` or ``"torchlean"``.
    """
    return Optimizer(RMSProp(lr, decay, eps, numerics=numerics))


def adam(
    lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, *, numerics: str = "fast"
) -> Optimizer:
    """Adam (torch's fused kernel, bit for bit ``torch.optim.Adam(fused=True)``).

    Args:
        lr: the learning rate.
        beta1: the first moment's decay.
        beta2: the second moment's decay.
        eps: added to the root of the bias-corrected second moment.
        numerics: ``"fast"`` or ``"torchlean"`` (upstream's formulas in upstream's order).

    Raises:
        ConfigError: a hyperparameter out of its range (also after rounding to a parameter's dtype).
    """
    return Optimizer(Adam(lr, beta1, beta2, eps, numerics=numerics))


def adamw(
    lr: float,
    weight_decay: float = 0.01,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    *,
    numerics: str = "fast",
) -> Optimizer:
    """AdamW: Adam with decoupled weight decay, ``p *= 1 - lr*weight_decay`` before the step (torch's
    fused kernel, bit for bit ``torch.optim.AdamW(fused=True)``).

    Args:
        lr: the learning rate.
        weight_decay: the decoupled decay (use ``per_slot`` to exempt biases and norms).
        beta1: the first moment's decay.
        beta2: the second moment's decay.
        eps: added to the root of the bias-corrected second moment.
        numerics: ``"fast"`` or ``"torchlean"``.
    """
    return Optimizer(AdamW(lr, weight_decay, beta1, beta2, eps, numerics=numerics))


def adadelta(lr: float = 1.0, rho: float = 0.9, eps: float = 1e-6, *, numerics: str = "fast") -> Optimizer:
    """Adadelta (torch's foreach kernels).

    Args:
        lr: scales the update (1.0 is the original method).
        rho: the averaging factor of both running averages.
        eps: added inside both roots.
        numerics: ``"fast"`` or ``"torchlean"``.
    """
    return Optimizer(Adadelta(lr, rho, eps, numerics=numerics))


def lion(lr: float, beta1: float = 0.9, beta2: float = 0.99, weight_decay: float = 0.0, *,
         numerics: str = "fast") -> Optimizer:
    """Lion: ``p -= lr * sign(lerp(m, g, 1-beta1))`` after ``p *= 1 - lr*weight_decay``,
    then ``m = lerp(m, g, 1-beta2)`` (see ``optim/lion_rule.py``). Use a learning rate 3-10x
    smaller than AdamW's. Upstream has no Lion: ``numerics="torchlean"`` is refused."""
    return Optimizer(Lion(lr, beta1, beta2, weight_decay, numerics=numerics))


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


# Constructors by kind: each registered rule's kinds (see ``rules.RULES``), each
# reached through the constructor of the same name above.
OPTIMIZERS = {kind: globals()[kind] for kind in HYPERS}

__all__ = [
    "Optimizer", "OptState", "Hyper", "SGD", "Adagrad", "RMSProp", "Adam", "AdamW", "Adadelta", "Lion",
    "SGDState", "MomentumState", "AdagradState", "RMSPropState", "AdamState", "AdadeltaState", "LionState",
    "Schedule", "Constant", "Step", "Exponential", "WarmupCosine",
    "sgd", "adagrad", "rmsprop", "adam", "adamw", "adadelta", "lion",
    "constant", "step", "exponential", "warmup_cosine", "OPTIMIZERS", "HYPERS",
]
