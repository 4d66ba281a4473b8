"""torch's schedulers by leantrain's constructor names, each made from a rate: ``one_cycle``,
``cosine_restarts``, ``multi_step`` and ``lambda_schedule`` build the ``lr_scheduler``
classes (``OneCycleLR``, ``CosineAnnealingWarmRestarts``, ``MultiStepLR``, ``LambdaLR``):
one implementation of each, torch's arithmetic, tested against torch at every index.
``optim.step`` and ``optim.exponential`` keep upstream's closed forms (``base * gamma **
k``, ``upstream.py``), which differ from torch's repeated products in the last bits
(``ExponentialLR``: 4 ulps by its 18th step).
"""

from __future__ import annotations

from typing import Callable

from ...errors import ConfigError
from ...validate import check_count, is_int, is_number
from ..hyper import check_rate
from .lr_scheduler import CosineAnnealingWarmRestarts, LambdaLR, MultiStepLR, OneCycleLR


def _built(op: str, make, *args, **kwargs):
    """``make(*args, **kwargs)`` (an ``lr_scheduler`` class), its refusals said as ``op``'s."""
    try:
        made = make(*args, **kwargs)
    except ConfigError as e:
        raise ConfigError(str(e).replace(f"lr_scheduler.{make.torch_name}", op, 1)) from None
    made.op = op  # its later messages (a rate at an index) name the constructor the user called
    return made


def one_cycle(max_lr: float, total_steps: int, pct_start: float = 0.3, anneal: str = "cos", div_factor: float = 25.0,
              final_div_factor: float = 1e4, three_phase: bool = False) -> OneCycleLR:
    """torch's ``OneCycleLR`` rate (``cycle_momentum`` aside: the rate only): from ``max_lr /
    div_factor`` up to ``max_lr`` over ``pct_start`` of the run, then down to ``initial /
    final_div_factor`` (``three_phase``: back to the initial rate first). It is
    ``lr_scheduler.OneCycleLR`` (torch's class, torch's bits), made from the rate alone."""
    op = "optim.one_cycle"
    check_rate(op, "max_lr", max_lr)
    check_count(op, "total_steps", total_steps, 1)
    if anneal not in ("cos", "linear"):
        raise ConfigError(f"{op}: anneal must be 'cos' or 'linear', got {anneal!r}")
    return _built(op, OneCycleLR, float(max_lr), float(max_lr), total_steps=total_steps, pct_start=pct_start,
                  anneal_strategy=anneal, cycle_momentum=False, div_factor=div_factor,
                  final_div_factor=final_div_factor, three_phase=three_phase)


def cosine_restarts(base: float, t_0: int, t_mult: int = 1, eta_min: float = 0.0) -> CosineAnnealingWarmRestarts:
    """torch's ``CosineAnnealingWarmRestarts``: ``eta_min + (base - eta_min) * (1 + cos(pi *
    t_cur / t_i)) / 2``, restarting after ``t_0`` indices, each period ``t_mult`` times the
    last. It is ``lr_scheduler.CosineAnnealingWarmRestarts`` made from the rate ``base``."""
    op = "optim.cosine_restarts"
    base, eta_min = check_rate(op, "base", base), check_rate(op, "eta_min", eta_min)
    check_count(op, "t_0", t_0, 1)
    check_count(op, "t_mult", t_mult, 1)
    return _built(op, CosineAnnealingWarmRestarts, base, t_0, t_mult, eta_min)


def multi_step(base: float, milestones, gamma: float = 0.1) -> MultiStepLR:
    """torch's ``MultiStepLR``: the rate multiplied by ``gamma`` at each milestone (a
    milestone listed twice multiplies by ``gamma**2``), as torch's repeated products. It is
    ``lr_scheduler.MultiStepLR`` made from the rate ``base``."""
    op = "optim.multi_step"
    base = check_rate(op, "base", base)
    if not (isinstance(milestones, (list, tuple)) and all(is_int(m) and m >= 0 for m in milestones)):
        raise ConfigError(f"{op}: milestones must be a list of integers >= 0, got {milestones!r}")
    if not (is_number(gamma) and 0.0 <= gamma <= 1.0):
        raise ConfigError(f"{op}: gamma must be in [0, 1], got {gamma!r}")
    return _built(op, MultiStepLR, base, list(milestones), gamma)


def lambda_schedule(base: float, fn: Callable[[int], float]) -> LambdaLR:
    """torch's ``LambdaLR``: ``base * fn(t)``, ``fn`` the user's function of the index (it
    must depend on the index alone, so a resumed run gets the same rates). It is
    ``lr_scheduler.LambdaLR`` made from the rate ``base``."""
    op = "optim.lambda_schedule"
    base = check_rate(op, "base", base)
    if not callable(fn):
        raise ConfigError(f"{op}: fn must be a function of the index, got {type(fn).__name__}")
    return _built(op, LambdaLR, base, fn)
