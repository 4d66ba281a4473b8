"""A torch scheduler object as leantrain's schedule of the same class: its arguments read
back from the object, its base rates (``base_lrs``) and the steps it took, so the ported
schedule's index 0 is the rate torch's optimizer holds now and every later index the rate
torch's would give after as many more ``step()`` calls. The replay starts from the
scheduler's construction, so a scheduler stepped only by ``step()`` ports exactly; one
stepped with an explicit epoch (deprecated in torch) or whose rates were edited by hand
does not, and is refused where that shows (its rate now differs from the replay's)."""

from __future__ import annotations

import math

import torch

from ....errors import ConfigError
from . import annealing, composed, factors
from .plateau import ReduceLROnPlateau
from .replay import check_replay


def _kind(opt) -> tuple:
    """The momentum a torch optimizer's groups have, as ``replay.describe`` reports it."""
    if "betas" in opt.defaults:
        return "betas", tuple(float(g["betas"][0]) for g in opt.param_groups)
    if "momentum" in opt.defaults:
        return "momentum", tuple(float(g["momentum"]) for g in opt.param_groups)
    return None, None


def _plain(value):
    return float(value.item()) if isinstance(value, torch.Tensor) else value  # a tensor rate: its value


def _rate_dtype(opt):
    """The dtype of the optimizer's tensor rates (``lr=torch.tensor(...)``: torch fills them and
    computes on them, so the replay holds one too), or ``None`` for number rates."""
    tensors = [g["lr"] for g in opt.param_groups if isinstance(g["lr"], torch.Tensor)]
    return tensors[0].dtype if tensors else None


def _build(s, op: str):
    """leantrain's plan for torch scheduler ``s`` (fresh: from its construction)."""
    opt = s.optimizer
    name = type(s).__name__
    if name in ("SequentialLR", "ChainedScheduler"):
        parts = [_build(p, op) for p in s._schedulers]
        plan = (composed.SequentialLR(parts[0]._rates_of, parts, list(s._milestones)) if name == "SequentialLR"
                else composed.ChainedScheduler(parts))
        plan.rate_dtype = _rate_dtype(opt)
        return plan
    bases = [_plain(g.get("initial_lr", g["lr"])) for g in opt.param_groups]
    rates = list(bases)
    c = {
        "LambdaLR": lambda: factors.LambdaLR(rates, list(s.lr_lambdas)),
        "MultiplicativeLR": lambda: factors.MultiplicativeLR(rates, list(s.lr_lambdas)),
        "StepLR": lambda: factors.StepLR(rates, s.step_size, s.gamma),
        "MultiStepLR": lambda: factors.MultiStepLR(rates, list(s.milestones.elements()), s.gamma),
        "ConstantLR": lambda: factors.ConstantLR(rates, s.factor, s.total_iters),
        "LinearLR": lambda: factors.LinearLR(rates, s.start_factor, s.end_factor, s.total_iters),
        "ExponentialLR": lambda: factors.ExponentialLR(rates, s.gamma),
        "PolynomialLR": lambda: factors.PolynomialLR(rates, s.total_iters, s.power),
        "CosineAnnealingLR": lambda: annealing.CosineAnnealingLR(rates, s.T_max, s.eta_min),
        "CosineAnnealingWarmRestarts": lambda: annealing.CosineAnnealingWarmRestarts(rates, s.T_0, s.T_mult,
                                                                                      s.eta_min),
        "SWALR": lambda: annealing.SWALR(rates, [g["swa_lr"] for g in opt.param_groups], s.anneal_epochs,
                                         s._anneal_strategy),
        "CyclicLR": lambda: _cyclic(s, rates),
        "OneCycleLR": lambda: _one_cycle(s, rates),
    }.get(name)
    if c is None:
        raise ConfigError(f"{op}: leantrain has no counterpart of {type(s).__module__}.{name}")
    plan = c()
    plan.rate_dtype = _rate_dtype(opt)
    kind, momenta = _kind(opt)
    plan.momentum_kind, plan.momenta = kind, momenta
    plan._rates_of = rates
    return plan


def _cyclic(s, rates):
    up = s.total_size * s.step_ratio
    down = s.total_size - up
    plan = annealing.CyclicLR(rates, list(s.base_lrs), list(s.max_lrs), int(round(up)), int(round(down)), s.mode,
                              s.gamma, s._scale_fn_custom, s.scale_mode, False)
    plan.total_size, plan.step_ratio = s.total_size, s.step_ratio  # torch's own floats
    if s.cycle_momentum:
        plan.cycle_momentum = True
        plan.base_momentums, plan.max_momentums = list(s.base_momentums), list(s.max_momentums)
    return plan


def _one_cycle(s, rates):
    groups = s.optimizer.param_groups
    plan = annealing.OneCycleLR(rates, [g["max_lr"] for g in groups], s.total_steps, cycle_momentum=False,
                                anneal_strategy=s._anneal_func_type)
    plan.phases = [(p["end_step"], p["start_lr"], p["end_lr"], p["start_momentum"], p["end_momentum"])
                   for p in s._schedule_phases]
    plan.group_values = [{k: g[k] for k in ("initial_lr", "max_lr", "min_lr")} for g in groups]
    if s.cycle_momentum:
        plan.cycle_momentum = True
        plan.max_momentums = [g["max_momentum"] for g in groups]
        plan.base_momentums = [g["base_momentum"] for g in groups]
    return plan


def _plateau(s) -> ReduceLROnPlateau:
    rates = [float(g["lr"]) for g in s.optimizer.param_groups]
    plan = ReduceLROnPlateau(rates, s.mode, s.factor, s.patience, s.threshold, s.threshold_mode, s.cooldown,
                             list(s.min_lrs), s.eps)
    plan.start = {"lr": rates[0], "lrs": rates, "best": s.best if math.isfinite(s.best) else None,
                  "bad": s.num_bad_epochs, "cooldown_left": s.cooldown_counter}
    plan.reset()  # where torch's stands; a fresh run starts there too (PlateauFeed.on_begin resets to it)
    return plan


def _steps(s) -> int:
    """The steps a torch scheduler took (a ``ChainedScheduler`` keeps no count: its parts')."""
    if hasattr(s, "last_epoch"):
        return s.last_epoch
    return _steps(s._schedulers[0])


def port_scheduler(s, op: str = "optim.from_torch"):
    """leantrain's schedule for torch scheduler ``s``: index 0 is the rate its optimizer holds now."""
    if isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return _plateau(s)
    check_replay(op, _steps(s), f"{type(s).__name__} stands")  # before a replay that would not end
    plan = _build(s, op)
    plan.skip = _steps(s)
    now = [_plain(g["lr"]) for g in s.optimizer.param_groups]
    if list(plan.rates_at(0)[0]) != now:
        raise ConfigError(f"{op}: {type(s).__name__} holds the rates {now}, but replaying it from its construction "
                          f"for {s.last_epoch} steps gives {list(plan.rates_at(0)[0])}: it was stepped with an epoch "
                          f"or its rates were set by hand, which a port cannot follow")
    return plan
