"""Optimizers and learning-rate schedules.

Constructors take the defaults of the TorchLean configs (spec §4)::

    opt = optim.adam(1e-3)
    state = opt.init(params)
    state = opt.step(state, params, grads)
"""

from __future__ import annotations

import inspect

from .hyper import SGD, Adadelta, Adagrad, Adam, AdamW, Hyper, Lion, RMSProp
from .hyper_torch import ASGD, Adafactor, Adamax, Muon, NAdam, RAdam, Rprop
from .optimizer import OptState, Optimizer
from .porting import from_torch
from .rules import (
    HYPERS,
    RECORDS,
    AdadeltaState,
    AdagradState,
    AdamState,
    LionState,
    MomentumState,
    RMSPropState,
    SGDState,
)
from .schedules import (  # every schedule: one package, its layout upstream's, torch's and transformers' (schedules/)
    Constant, ConstantWithWarmup, CosineWarmupWithMinLR, CosineWithMinLR, CosineWithWarmup, Exponential, Greedy,
    InverseSqrt, Linear, Plateau, Polynomial, Schedule, Sequential, Step, WarmupCosine, WarmupStableDecay,
    cosine_restarts, lambda_schedule, multi_step, one_cycle,
)


# Every constructor takes ``numerics``: "fast" (the default: torch's kernels) or
# "torchlean" (upstream's per-tensor formulas, one rounding per written operation, on
# the host path; slower; for replaying a run against TorchLean bit for bit), and
# torch.optim's keyword names (``constructors.py``).
from .constructors import (  # noqa: E402
    CONSTRUCTORS, adadelta, adafactor, adagrad, adam, adamax, adamw, asgd, lion, muon, nadam, radam, rmsprop, rprop, sgd,
)


from .schedules.lr_scheduler import ChainedScheduler  # noqa: E402
from . import lr_scheduler  # noqa: E402  (torch's names: schedules/lr_scheduler/, by their public path)
from .schedules.transformers_names import *  # noqa: E402,F401,F403
from .schedules import transformers_names  # noqa: E402

# Every schedule class that declares a ``constructor`` (``Schedule.constructor``) gets a
# function of that name here, taking the class's own arguments: ``optim.linear(1e-3, 10,
# 100)`` is ``Linear(1e-3, 10, 100)``. Adding a schedule is its class and one line below.
SCHEDULES = (Constant, Step, Exponential, WarmupCosine, Linear, CosineWithWarmup, WarmupStableDecay, Polynomial,
             InverseSqrt, ConstantWithWarmup, CosineWithMinLR, CosineWarmupWithMinLR, Sequential, Plateau, Greedy,
             ChainedScheduler)
# torch's schedulers by leantrain's names: functions building the lr_scheduler classes (one implementation each)
TORCH_NAMED = {"one_cycle": one_cycle, "cosine_restarts": cosine_restarts, "multi_step": multi_step,
               "lambda_schedule": lambda_schedule}


def _forwarding(cls):
    def build(*args, **kwargs):
        return cls(*args, **kwargs)

    build.__name__ = build.__qualname__ = cls.constructor
    build.__doc__ = cls.__doc__
    build.__signature__ = inspect.signature(cls).replace(return_annotation=cls.__name__)
    build.__module__ = __name__
    build.__wrapped__ = cls  # documented as its class (the reference's entry)
    return build


SCHEDULE_CONSTRUCTORS = {**{cls.constructor: _forwarding(cls) for cls in SCHEDULES}, **TORCH_NAMED}
globals().update(SCHEDULE_CONSTRUCTORS)


# Constructors by kind: each registered rule's kinds (see ``rules.RULES``), each
# reached through the constructor of the same name above.
OPTIMIZERS = {kind: CONSTRUCTORS[kind] for kind in HYPERS}
globals().update({h.__name__: h for h in HYPERS.values()}, **RECORDS)  # every kind's hyperparameters and records

__all__ = [
    "Optimizer", "OptState", "Hyper", "from_torch", "OPTIMIZERS", "HYPERS", "CONSTRUCTORS", "Schedule", "SCHEDULES",
    "lr_scheduler", *(h.__name__ for h in HYPERS.values()), *RECORDS, *CONSTRUCTORS,
    *(cls.__name__ for cls in SCHEDULES), *SCHEDULE_CONSTRUCTORS, *transformers_names.__all__,
]
