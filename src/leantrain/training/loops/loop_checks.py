"""What a loop checks before it starts, so that a refused start changes nothing: the
runner and config it is given, the schedule against the parameters' dtypes, the
callbacks (an ``EarlyStopping`` needs evaluations that give what it watches). A resumed
checkpoint's checks are the ``Checkpointer``'s (``checkpointing.py``)."""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Sequence

import numpy
import torch

from ...errors import ConfigError
from ...optim.schedules.plateau import Plateau
from ...optim.rules import elementwise

from .callbacks import Callback, EarlyStopping, PlateauFeed, ProgressBar
from ...params.meta import refuse_unfilled
from ..runner.runner import Runner
from ..parallel.sharding.state import check_shardable
from ..parallel.distributed import join_launcher
from ..parallel.sharding.strategy import ends_whole


def check_inputs(op: str, runner: object, cfg: object, kind: type) -> None:
    if not isinstance(runner, Runner):
        raise ConfigError(f"{op}: expected a Runner, got {type(runner).__name__}")
    if not isinstance(cfg, kind):
        raise ConfigError(f"{op}: expected a {kind.__name__}, got {type(cfg).__name__}")
    par = cfg.parallel
    join_launcher(op, runner.device, par.collective_timeout)  # torchrun's processes train one run, not N
    if par.sharded:
        check_shardable(op, runner)
        if not elementwise(cfg.optimizer.hyper):
            raise ConfigError(
                f"{op}: {par.cut_by} cuts each slot's optimizer state into ranges, but "
                f"{cfg.optimizer.kind} updates a whole matrix at a time (Newton-Schulz needs it whole); "
                f"train it unsharded, or with data parallelism alone")
    check_filling(op, runner, cfg)
    if cfg.autocast == "float16":  # as torch's GradScaler, which refuses to unscale float16 gradients
        for i, (v, c) in enumerate(zip(runner.params, runner.params.canonical_slot_indices())):
            if c == i and v.dtype == torch.float16:
                raise ConfigError(
                    f"{op}: autocast='float16' with {runner.params.label(i)} in float16: loss scaling needs "
                    f"float32 parameters (their gradients are unscaled in float32); keep the parameters in "
                    f"float32 (autocast computes in float16), or use autocast='bfloat16'")


def check_filling(op: str, runner: Runner, cfg) -> None:
    """A model built on torch's meta device (``params/meta.py``) is filled by a
    ``"parameters"`` run's ``init_weights``/``init_from`` or by a resumed checkpoint; the
    two options fill only such a model; a run that ends with the module released keeps its
    result in its checkpoint, so it needs one."""
    par, resume_from = cfg.parallel, cfg.checkpoints.resume_from
    fills = par.init_weights is not None or par.init_from is not None
    resumes = resume_from is not None and resume_from != "auto"
    if runner.unfilled and not fills and not resumes:
        refuse_unfilled(op, runner.unfilled)
    if fills and not runner.unfilled:
        raise ConfigError(f"{op}: init_weights/init_from fill a model built on torch's meta device, but this "
                          f"model's tensors all have values (nothing to fill): build the model under "
                          f"torch.device('meta'), or drop the option")
    if par.sharding == "parameters" and not ends_whole(par, runner) and cfg.checkpoints.path is None:
        raise ConfigError(f"{op}: this sharding='parameters' run ends with the module released (a model built on "
                          f"meta, or gather_at_end=False): its result is its sharded checkpoint; set "
                          f"checkpoint_path, or gather_at_end=True")


def check_start(op: str, cfg, runner: Runner, one_process: bool) -> None:
    """What a run checks of its schedule and its averaged model before anything runs."""
    check_schedule(op, cfg, runner)
    if cfg.averaging is not None:
        cfg.averaging.check(op, runner.module, hasattr(cfg, "epochs"), one_process)


def run_optimizer(op: str, cfg):
    """The optimizer a run steps with: ``cfg.optimizer``, or, for an SGD made without
    momentum under a schedule that cycles it (torch's ``OneCycleLR``/``CyclicLR`` default
    ``cycle_momentum=True``), that SGD with the schedule's first momentum: torch writes the
    momentum into the group before the first step, so its SGD keeps a buffer from there
    (its momentum then set by the schedule at every step), as this one does."""
    opt, sched = cfg.optimizer, cfg.scheduler
    if not getattr(sched, "starts_momentum", False):
        return opt
    if opt.kind != "sgd" or any("momentum" in o for o in opt.group_options):
        raise ConfigError(f"{op}: the scheduler cycles the momentum of a {opt.kind} made with momentum=0, whose "
                          f"updates keep no momentum buffer; make it with momentum > 0, or the scheduler with "
                          f"cycle_momentum=False")
    return dataclasses.replace(opt, hyper=dataclasses.replace(opt.hyper, momentum=sched.max_momentums[0]),
                               _resolved={})


def check_schedule(op: str, cfg, runner: Runner) -> None:
    """Refuse, before training starts, a schedule whose largest rate does not survive
    rounding to a trainable parameter's dtype (``1e308`` is infinite in binary32), and a
    torch-named schedule made for other param groups or another kind of momentum than
    the optimizer's."""
    _check_groups(op, cfg)
    peak = None if cfg.scheduler is None else cfg.scheduler.max_rate()
    if peak is None:
        return
    for i, (v, c) in enumerate(zip(runner.params, runner.params.canonical_slot_indices())):
        if c == i and not math.isfinite(float(torch.tensor(peak, dtype=torch.float64).to(v.dtype))):
            raise ConfigError(
                f"{op}: scheduler: its largest rate {peak!r} is not finite after conversion to "
                f"{str(v.dtype).removeprefix('torch.')} ({runner.params.label(i)})"
            )


def _check_groups(op: str, cfg) -> None:
    from ...optim.schedules.lr_scheduler.replay import describe

    sched = cfg.scheduler
    bases = getattr(sched, "bases", None)
    if not bases:
        return
    ours, kind, _ = describe(cfg.optimizer)
    if len(bases) != len(ours):
        raise ConfigError(f"{op}: the scheduler was made for {len(bases)} param group(s), the optimizer has "
                          f"{len(ours)}: make the scheduler with the optimizer the loop trains with")
    cycles = getattr(sched, "cycles_momentum", lambda: False)()
    if cycles and sched.momentum_kind != kind:
        raise ConfigError(f"{op}: the scheduler cycles the {sched.momentum_kind} of the optimizer it was made "
                          f"with, but the loop trains with {cfg.optimizer.kind} "
                          f"({'no momentum' if kind is None else kind}): make the scheduler with this optimizer")


def loop_callbacks(op: str, cfg, callbacks: Sequence[Callback], main: bool) -> list[Callback]:
    """The run's callbacks, checked, alike on every rank (each rank runs those it should:
    ``Listeners``); plus a progress bar when the loop runs in a terminal with logging on
    (never on other ranks, in tests or under ``log_every=0``)."""
    if isinstance(callbacks, Callback) or not isinstance(callbacks, (list, tuple)):
        raise ConfigError(f"{op}: callbacks must be a list of leantrain Callback objects, got {type(callbacks).__name__}")
    for i, cb in enumerate(callbacks):
        if not isinstance(cb, Callback):
            raise ConfigError(f"{op}: callbacks[{i}] is a {type(cb).__name__}, not a leantrain Callback")
    evaluates, names = cfg.evaluation.data is not None, cfg.evaluation.result_names()
    for cb in callbacks:
        if isinstance(cb, EarlyStopping) and cb.monitor == EarlyStopping.TRAIN:
            if not cfg.log_every:
                raise ConfigError(f"{op}: EarlyStopping monitors 'train_loss', the loss of each logged update: "
                                  f"set log_every > 0 (how often it is checked)")
        elif isinstance(cb, EarlyStopping):  # refused before training, not after the first evaluation
            if not evaluates:
                raise ConfigError(f"{op}: EarlyStopping watches evaluations: set eval_data (and eval_every), or "
                                  f"monitor='train_loss' (the loss of the logged updates)")
            if cb.monitor not in names:
                raise ConfigError(f"{op}: EarlyStopping monitors {cb.monitor!r}, but the evaluations give "
                                  f"{sorted(names)}")
    out = list(callbacks)
    if isinstance(cfg.scheduler, Plateau):
        if not evaluates:
            raise ConfigError(f"{op}: the plateau schedule reads evaluations: set eval_data (and eval_every)")
        if cfg.scheduler.monitor not in names:
            raise ConfigError(f"{op}: the plateau schedule monitors {cfg.scheduler.monitor!r}, but the evaluations "
                              f"give {sorted(names)}")
        out.insert(0, PlateauFeed(cfg.scheduler))
    if main and cfg.log_every and sys.stderr.isatty() and not any(isinstance(c, ProgressBar) for c in out):
        out.append(ProgressBar())
    for cb in out:
        cb.check_names(op, names)  # a tracker's rules, before the first update rather than at the first evaluation
    return out


def wants_stop(op: str, who: str, value: object) -> bool:
    """A hook's answer: ``True`` stops the run, ``None`` or ``False`` goes on; anything
    else (a tensor would need a device read, a string is always true) is refused."""
    if value is None or isinstance(value, (bool, numpy.bool_)):
        return bool(value)
    raise ConfigError(f"{op}: {who} returned {type(value).__name__} {value!r:.40}; return True to stop the run, "
                      f"or None (or False) to go on")
