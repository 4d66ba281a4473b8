"""torch's learning-rate schedulers by their own names and arguments (``leantrain.optim.lr_scheduler``):
the classes of ``leantrain.optim.schedules.lr_scheduler`` at their public path (see there)."""

from .schedules.lr_scheduler import *  # noqa: F401,F403
from .schedules.lr_scheduler import CLASSES, __all__  # noqa: F401
