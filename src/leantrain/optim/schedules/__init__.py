"""Learning-rate schedules, one concept in one package. A schedule gives each param
group's rate at a 0-based index (``Schedule.lr_at``/``rates_at``); a loop asks it index
by index (per update, or per epoch with ``schedule_per="epoch"``). The layout shows where
each comes from:

* ``upstream.py``: TorchLean's own forms (spec §4), the base ``Schedule``, and
  ``Sequential`` (schedules of any form one after another, each from its index 0);
* ``lr_scheduler/``: torch's schedulers by torch's names and arguments
  (``leantrain.optim.lr_scheduler``), replaying torch's arithmetic for torch's bits, and
  their port (``optim.from_torch``); ``torch_names.py``: the same classes by leantrain's
  constructor names, made from a rate (``optim.one_cycle``, ``multi_step``,
  ``cosine_restarts``, ``lambda_schedule``): one implementation of each;
* ``transformers_forms.py``: transformers' schedule shapes (warm-up, cosine, polynomial,
  warmup-stable-decay...); ``transformers_names.py``: transformers' function names and
  ``get_scheduler`` (Trainer's ``lr_scheduler_type``); ``greedy.py``: its greedy schedule;
* ``plateau.py``: the rule of ``ReduceLROnPlateau``, fed the loop's evaluations.
"""

from .upstream import Constant, Exponential, Schedule, Sequential, Step, WarmupCosine
from .plateau import Plateau
from .transformers_forms import (
    ConstantWithWarmup, CosineWarmupWithMinLR, CosineWithMinLR, CosineWithWarmup, InverseSqrt, Linear, Polynomial,
    WarmupStableDecay,
)
from .greedy import Greedy
from .torch_names import cosine_restarts, lambda_schedule, multi_step, one_cycle
from . import lr_scheduler, transformers_names

__all__ = ["Schedule", "Constant", "Step", "Exponential", "WarmupCosine", "Sequential", "Plateau", "Greedy",
           "ConstantWithWarmup", "CosineWarmupWithMinLR", "CosineWithMinLR", "CosineWithWarmup", "InverseSqrt",
           "Linear", "Polynomial", "WarmupStableDecay", "one_cycle", "multi_step", "cosine_restarts",
           "lambda_schedule", "lr_scheduler", "transformers_names"]
