"""What a loop checks before it starts, so that a refused start changes nothing: the
runner and config it is given, the schedule against the parameters' dtypes, the
callbacks (an ``EarlyStopping`` needs evaluations that give what it watches), and a
resumed checkpoint's progress record."""

from __future__ import annotations

import json
import math
import sys
import warnings
from typing import Sequence

import numpy
import torch

from ...errors import ConfigError
from ...optim.plateau import Plateau
from ...optim.rules import elementwise
from ...validate import is_int, is_number
from .callbacks import Callback, EarlyStopping, PlateauFeed, ProgressBar
from .evaluation import result_names
from ..runner.precision import scaler_state_problems
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
            names = result_names(cfg)
            if cb.monitor not in names:
                raise ConfigError(f"{op}: EarlyStopping monitors {cb.monitor!r}, but the evaluations give "
                                  f"{sorted(names)}")
    out = [cb for cb in callbacks if main or cb.every_rank]
    if isinstance(cfg.scheduler, Plateau):
        if cfg.eval_data is None:
            raise ConfigError(f"{op}: the plateau schedule reads evaluations: set eval_data (and eval_every)")
        names = result_names(cfg)
        if cfg.scheduler.monitor not in names:
            raise ConfigError(f"{op}: the plateau schedule monitors {cfg.scheduler.monitor!r}, but the evaluations "
                              f"give {sorted(names)}")
        out.insert(0, PlateauFeed(cfg.scheduler))
    if main and cfg.log_every and sys.stderr.isatty() and not any(isinstance(c, ProgressBar) for c in out):
        out.append(ProgressBar())
    return out


def check_savable(op: str, callbacks: Sequence[Callback]) -> None:
    """Each callback's saved state is JSON data (a checkpoint's progress holds it): checked
    when the loop starts, so a tensor in it is refused before the first update, not at
    the first save."""
    for cb in callbacks:
        state = cb.state_dict()
        if state is None:
            continue
        try:
            json.dumps(state, allow_nan=True)
        except (TypeError, ValueError, RecursionError) as e:
            raise ConfigError(f"{op}: {type(cb).__name__}.state_dict() is not JSON data ({e}); a checkpoint saves "
                              f"it as JSON: return numbers, strings, lists and dicts (float(t) for a tensor "
                              f"t)") from None


def restore_callbacks(op: str, callbacks: Sequence[Callback], saved: list) -> None:
    """Give the callbacks that keep state theirs back (the same kinds in the same order
    as when saved); otherwise say that they start afresh."""
    mine = stateful(callbacks)
    kinds = [type(cb).__name__ for cb in mine]
    if kinds == [kind for kind, _ in saved]:
        for cb, (_, state) in zip(mine, saved):
            cb.load_state_dict(state)
    elif saved or mine:
        warnings.warn(f"{op}: the checkpoint carries the state of the callbacks {[k for k, _ in saved]}, this "
                      f"run's callbacks keeping state are {kinds}: they start afresh", stacklevel=5)


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


def resume_check(kind: str, cfg, expect: dict, want_path: str, scaling: bool, extra: list):
    """``accept(manifest, tensors)`` for ``load_checkpoint``: why a checkpoint cannot resume
    this ``kind`` of loop (its progress, ``expect``, the moving average, the update path,
    the float16 loss scale when ``scaling``, and each of ``extra``'s problems), decided
    before anything is installed."""
    def fits(manifest: dict, tensors: dict) -> list[str]:
        p = manifest.get("progress") or {}
        if not isinstance(p, dict) or p.get("kind") != kind or not manifest.get("optimizer"):
            return [f"not a {kind} training checkpoint with optimizer state"]
        problems = progress_problems(kind, p)
        if scaling and p.get("autocast") == "float16":
            problems += scaler_state_problems(p)
        problems += [f"{key}: checkpoint has {p.get(key, EXPECT_DEFAULTS.get(key))!r}, this run has {value!r}"
                     for key, value in expect.items() if p.get(key, EXPECT_DEFAULTS.get(key)) != value]
        e = manifest.get("ema")
        if cfg.ema_decay is not None and (e is None or e["decay"] != cfg.ema_decay):
            problems.append(f"ema: checkpoint has {None if e is None else e['decay']!r}, "
                            f"this run has ema_decay={cfg.ema_decay!r}")
        if manifest["optimizer"].get("path") != want_path:
            problems.append(f"the checkpoint's optimizer history is {manifest['optimizer'].get('path')}; "
                            f"resume with parameters on the same kind of device")
        for check in extra:
            problems += check(manifest, tensors)
        return problems

    return fits
