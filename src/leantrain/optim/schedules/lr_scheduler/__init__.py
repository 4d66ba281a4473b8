"""torch's learning-rate schedulers by their own names and arguments, as leantrain schedules.

``scheduler = CosineAnnealingLR(opt, T_max=100)`` ports as written: ``opt`` is the
leantrain optimizer (its param groups' rates, and the momentum or first beta that
``OneCycleLR`` and ``CyclicLR`` cycle), or a rate; every class gives the rates torch's
gives after the same number of ``step()`` calls, bit for bit (torch's in-place
recursions replayed, not closed forms: ``replay.py``). Give it to a loop as
``scheduler=``; the loop asks the rate of each update (or epoch) by index, so there is
no ``step()`` to call. ``optim.from_torch(torch_scheduler)`` ports a torch scheduler
object (its class, arguments and the steps it took).
"""

from .annealing import SWALR, CosineAnnealingLR, CosineAnnealingWarmRestarts, CyclicLR, OneCycleLR
from .composed import ChainedScheduler, SequentialLR
from .factors import (
    ConstantLR, ExponentialLR, LambdaLR, LinearLR, MultiplicativeLR, MultiStepLR, PolynomialLR, StepLR,
)
from .plateau import ReduceLROnPlateau
from .replay import LRScheduler

#: torch's class name -> leantrain's class of the same name (``torch.optim.lr_scheduler`` and ``swa_utils.SWALR``)
CLASSES = {cls.torch_name: cls for cls in (
    LambdaLR, MultiplicativeLR, StepLR, MultiStepLR, ConstantLR, LinearLR, ExponentialLR, PolynomialLR,
    CosineAnnealingLR, CosineAnnealingWarmRestarts, CyclicLR, OneCycleLR, SWALR, SequentialLR, ChainedScheduler,
    ReduceLROnPlateau)}

__all__ = ["LRScheduler", "CLASSES", *CLASSES]
