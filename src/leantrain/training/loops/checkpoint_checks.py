"""What a run checks of the checkpoints it resumes and saves, before anything changes: a
checkpoint's progress record (``progress_problems``), whether a checkpoint fits this run
(``resume_check``: its kind, the settings it must match, its moving average and averaged
model, its update path), the callbacks' saved states (``check_savable`` when a run starts,
``restore_callbacks`` when it resumes). The ``Checkpointer`` (``checkpointing.py``) calls them.
"""

from __future__ import annotations

import json
import warnings
from typing import Sequence

from ...errors import ConfigError
from ...validate import is_int, is_number
from ..runner.precision import scaler_state_problems
from .callbacks import Callback

# What a checkpoint written before a setting existed implies for it.
EXPECT_DEFAULTS = {"accumulate": 1, "ema_decay": None, "autocast": None, "limit_train_batches": None}


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
                      f"run's callbacks keeping state are {kinds}: they start afresh", stacklevel=6)


def stateful(callbacks: Sequence[Callback]) -> list[Callback]:
    """The callbacks that carry state across a resume (``state_dict()`` is not None)."""
    return [cb for cb in callbacks if cb.state_dict() is not None]


def progress_problems(kind: str, p: dict) -> list[str]:
    """Why a saved progress record cannot resume a ``kind`` loop: each field it needs,
    of the wrong type or out of range."""
    out = []
    counts = ("step",) + (("epoch", "batch", "seen") if kind == "loader" else ())
    for key in counts:
        v = p.get(key)
        if not (is_int(v) and 0 <= v < 2**63):
            out.append(f"progress.{key}: expected an integer >= 0, got {v!r}")
    if "tokens_seen" in p and not (is_int(p["tokens_seen"]) and 0 <= p["tokens_seen"] < 2**63):
        out.append(f"progress.tokens_seen: expected an integer >= 0, got {p['tokens_seen']!r:.40}")
    pending = p.get("train_loss_pending", [])
    if "train_loss_sum" in p and not (is_number(p["train_loss_sum"]) and is_int(p.get("train_loss_updates"))
                                      and 0 <= p["train_loss_updates"] < 2**63 and isinstance(pending, list)
                                      and len(pending) < 2**16 and all(is_number(v) for v in pending)):
        out.append(f"progress.train_loss_sum/_updates/_pending: expected a number, an integer >= 0 and a short "
                   f"list of numbers, got {p['train_loss_sum']!r:.40}, {p.get('train_loss_updates')!r:.40}, "
                   f"{pending!r:.40}")
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
    if p.get("checkpoint_folder") is not None and not isinstance(p.get("checkpoint_folder"), str):
        out.append(f"progress.checkpoint_folder: expected a string, got {p.get('checkpoint_folder')!r:.40}")
    return out


def resume_check(kind: str, expect: dict, ema_decay, averaging, want_path: str, scaling: bool, extra: list):
    """``accept(manifest, tensors)`` for ``load_checkpoint``: why a checkpoint cannot resume
    this ``kind`` of loop (its progress, ``expect``, the moving average of ``ema_decay``,
    the ``averaging``'s model, the update path, the float16 loss scale when ``scaling``,
    and each of ``extra``'s problems), decided before anything is installed."""
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
        if ema_decay is not None and (e is None or e["decay"] != ema_decay):
            problems.append(f"ema: checkpoint has {None if e is None else e['decay']!r}, "
                            f"this run has ema_decay={ema_decay!r}")
        if averaging is not None and manifest.get("averaged") is None:
            problems.append("averaged: the checkpoint keeps no averaged model, this run has averaging")
        elif averaging is not None and not averaging.fits(
                {name: tensors[f"averaged.{name}"] for name in manifest["averaged"] if f"averaged.{name}" in tensors}):
            problems.append("averaged: the checkpoint's averaged model does not fit this run's AveragedModel "
                            "(names, shapes or dtypes differ)")
        if manifest["optimizer"].get("path") != want_path:
            problems.append(f"the checkpoint's optimizer history is {manifest['optimizer'].get('path')}; "
                            f"resume with parameters on the same kind of device")
        for check in extra:
            problems += check(manifest, tensors)
        return problems

    return fits
