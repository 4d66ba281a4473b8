"""What a loop checks before it starts, so that a refused start changes nothing: the
runner and config it is given, the schedule against the parameters' dtypes, the
callbacks (an ``EarlyStopping`` needs evaluations that give what it watches), and a
resumed checkpoint's progress record."""

from __future__ import annotations

import math
import sys
from typing import Sequence

import numpy
import torch

from ...errors import ConfigError
from ...optim.plateau import Plateau
from ...optim.rules import elementwise
from ...validate import is_int, is_number
from .callbacks import Callback, EarlyStopping, PlateauFeed, ProgressBar
from ..runner.runner import Runner
from ..parallel.sharding.state import check_shardable


def check_inputs(op: str, runner: object, cfg: object, kind: type) -> None:
    if not isinstance(runner, Runner):
        raise ConfigError(f"{op}: expected a Runner, got {type(runner).__name__}")
    if not isinstance(cfg, kind):
        raise ConfigError(f"{op}: expected a {kind.__name__}, got {type(cfg).__name__}")
    if cfg.sharding is not None:
        check_shardable(op, runner)
        if not elementwise(cfg.optimizer.hyper):
            raise ConfigError(
                f"{op}: sharding={cfg.sharding!r} cuts each slot's optimizer state into ranges, but "
                f"{cfg.optimizer.kind} updates a whole matrix at a time (Newton-Schulz needs it whole); "
                f"train it unsharded, or with data parallelism alone")
    if cfg.autocast == "float16":  # as torch's GradScaler, which refuses to unscale float16 gradients
        for i, (v, c) in enumerate(zip(runner.params, runner.params.canonical_slot_indices())):
            if c == i and v.dtype == torch.float16:
                raise ConfigError(
                    f"{op}: autocast='float16' with {runner.params.label(i)} in float16: loss scaling needs "
                    f"float32 parameters (their gradients are unscaled in float32); keep the parameters in "
                    f"float32 (autocast computes in float16), or use autocast='bfloat16'")


def check_schedule(op: str, cfg, runner: Runner) -> None:
    """Refuse, before training starts, a schedule whose largest rate does not survive
    rounding to a trainable parameter's dtype (``1e308`` is infinite in binary32)."""
    peak = None if cfg.scheduler is None else cfg.scheduler.max_rate()
    if peak is None:
        return
    for i, (v, c) in enumerate(zip(runner.params, runner.params.canonical_slot_indices())):
        if c == i and not math.isfinite(float(torch.tensor(peak, dtype=torch.float64).to(v.dtype))):
            raise ConfigError(
                f"{op}: scheduler: its largest rate {peak!r} is not finite after conversion to "
                f"{str(v.dtype).removeprefix('torch.')} ({runner.params.label(i)})"
            )


def loop_callbacks(op: str, cfg, callbacks: Sequence[Callback], main: bool) -> list[Callback]:
    """The run's callbacks: checked; on ranks other than 0 only those that run on every
    rank (``every_rank``); plus a progress bar when the loop runs in a terminal with
    logging on (never on other ranks, in tests or under ``log_every=0``)."""
    if isinstance(callbacks, Callback) or not isinstance(callbacks, (list, tuple)):
        raise ConfigError(f"{op}: callbacks must be a list of leantrain Callback objects, got {type(callbacks).__name__}")
    for i, cb in enumerate(callbacks):
        if not isinstance(cb, Callback):
            raise ConfigError(f"{op}: callbacks[{i}] is a {type(cb).__name__}, not a leantrain Callback")
    for cb in callbacks:
        if isinstance(cb, EarlyStopping):  # refused before training, not after the first evaluation
            if cfg.eval_data is None:
                raise ConfigError(f"{op}: EarlyStopping watches evaluations: set eval_data (and eval_every)")
            names = {"loss", "items", *(cfg.eval_metrics or {})}
            if cb.monitor not in names:
                raise ConfigError(f"{op}: EarlyStopping monitors {cb.monitor!r}, but the evaluations give "
                                  f"{sorted(names)}")
    out = [cb for cb in callbacks if main or cb.every_rank]
    if isinstance(cfg.scheduler, Plateau):
        if cfg.eval_data is None:
            raise ConfigError(f"{op}: the plateau schedule reads evaluations: set eval_data (and eval_every)")
        names = {"loss", "items", *(cfg.eval_metrics or {})}
        if cfg.scheduler.monitor not in names:
            raise ConfigError(f"{op}: the plateau schedule monitors {cfg.scheduler.monitor!r}, but the evaluations "
                              f"give {sorted(names)}")
        out.insert(0, PlateauFeed(cfg.scheduler))
    if main and cfg.log_every and sys.stderr.isatty() and not any(isinstance(c, ProgressBar) for c in out):
        out.append(ProgressBar())
    return out


def stateful(callbacks: Sequence[Callback]) -> list[Callback]:
    """The callbacks that carry state across a resume (``state_dict()`` is not None)."""
    return [cb for cb in callbacks if cb.state_dict() is not None]


def wants_stop(op: str, who: str, value: object) -> bool:
    """A hook's answer: ``True`` stops the run, ``None`` or ``False`` goes on; anything
    else (a tensor would need a device read, a string is always true) is refused."""
    if value is None or isinstance(value, (bool, numpy.bool_)):
        return bool(value)
    raise ConfigError(f"{op}: {who} returned {type(value).__name__} {value!r:.40}; return True to stop the run, "
                      f"or None (or False) to go on")


# What a checkpoint written before a setting existed implies for it.
EXPECT_DEFAULTS = {"accumulate": 1, "ema_decay": None, "autocast": None}


def progress_problems(kind: str, p: dict) -> list[str]:
    """Why a saved progress record cannot resume a ``kind`` loop: each field it needs,
    of the wrong type or out of range."""
    out = []
    counts = ("step",) + (("epoch", "batch", "seen") if kind == "loader" else ())
    for key in counts:
        v = p.get(key)
        if not (is_int(v) and 0 <= v < 2**63):
            out.append(f"progress.{key}: expected an integer >= 0, got {v!r}")
    if p.get("before") is not None and not is_number(p.get("before")):
        out.append(f"progress.before: expected a number or null, got {p.get('before')!r}")
    for key in ("losses", "grad_norms"):
        pairs = p.get(key, [] if key == "grad_norms" else None)
        if not (isinstance(pairs, list) and all(
                isinstance(x, list) and len(x) == 2 and is_int(x[0]) and is_number(x[1]) for x in pairs)):
            out.append(f"progress.{key}: expected a list of [step, value] pairs")
    saved = p.get("callbacks", [])
    if not (isinstance(saved, list) and all(
            isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], dict) for x in saved)):
        out.append("progress.callbacks: expected a list of [callback kind, state] pairs")
    evals = p.get("evals", [])
    if not (isinstance(evals, list) and all(
            isinstance(x, list) and len(x) == 2 and is_int(x[0]) and isinstance(x[1], dict) for x in evals)):
        out.append("progress.evals: expected a list of [step, results] pairs")
    return out
