"""Loading a checkpoint (``load_checkpoint``): the file read whole and checked, then
checked against the destination (its slots, its optimizer and per-slot settings, the
caller's own problems with it), every problem named at once; only then is anything
installed (parameters, optimizer state, generators). A rejected load changes nothing."""

from __future__ import annotations

import random

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

import numpy
import torch

from .atomic import PathLike
from .checkfile import raise_all
from .checkpoint import read_checked
from ..optim import OptState, Optimizer
from ..optim.optimizer import NATIVE
from ..optim import rules as R
from ..params.dense import to_layout
from ..params.paramlist import ParamList, params_of


@dataclass
class Checkpoint:
    """What ``load_checkpoint`` restored besides the parameters."""

    path: Path
    manifest: dict
    state: Optional[OptState] = None
    progress: dict = field(default_factory=dict)
    loader_state: Optional[dict] = None
    ema: Optional[dict] = None  # {"decay", "count", "values": {storage index: CPU tensor}}
    averaged: Optional[dict] = None  # a torch AveragedModel's state: {name: CPU tensor}
    # storage index -> its values with only the reader's ranges read in (``wanted``): not installed
    ranged: dict = field(default_factory=dict)


def _fit_problems(manifest: dict, tensors: dict, checked, params: ParamList, optimizer, follow: bool = False
                  ) -> tuple[list[str], Optional[Optimizer]]:
    """Why a sound file (``read_checked`` checked it whole: every tensor of the dtype and
    shape its manifest implies) cannot be loaded into ``params`` and ``optimizer``, each
    cause once: the slot schema (the stored tensors follow it, so where it differs no
    tensor or record is reported besides), the optimizer's configuration and per-slot
    settings, and, when the schema fits, a record of the rule's type for every history
    the destination has."""
    here = params.schema()
    if follow and checked.schema.requires_grad != here.requires_grad:
        here = here.with_requires_grad(checked.schema.requires_grad)  # the run's trainable set, as saved
    problems = checked.schema.differences(here)
    if manifest["rng"].get("torch"):
        try:  # torch refuses an all-zero or truncated state: said before anything is installed
            torch.Generator().set_state(tensors["rng.torch"])
        except RuntimeError as e:
            problems.append(f"rng: 'rng.torch' is not a generator state torch takes ({str(e).splitlines()[0]})")
    problems += _py_numpy_problems(manifest["rng"], tensors)
    fits = not problems
    if fits and torch.cuda.is_available():  # the generators' states are restored only after everything else
        for d in range(min(manifest["rng"]["cuda"], torch.cuda.device_count())):
            size, saved_size = torch.cuda.get_rng_state(d).numel(), tensors[f"rng.cuda.{d}"].numel()
            if saved_size != size:
                problems.append(f"rng: 'rng.cuda.{d}' holds {saved_size} bytes; CUDA device {d}'s generator "
                                f"state is {size}")
    entry = manifest.get("optimizer")
    if entry is None:
        return problems, None
    saved = Optimizer(checked.hyper)
    if optimizer is not None and optimizer.hyper.without_lr() != saved.hyper.without_lr():
        problems.append(
            f"optimizer: checkpoint has {saved.hyper.describe()}, destination uses "
            f"{optimizer.hyper.describe()}; load with the same optimizer or without one"
        )
    if optimizer is not None:
        asked = optimizer.settings("load_checkpoint", params)[1]
        if saved_overrides(entry) != asked:
            problems.append(f"optimizer: per-slot hyperparameters: checkpoint has {entry.get('per_slot', [])}, "
                            f"destination asks for {[[i, dict(kv)] for i, kv in asked]}")
    if not fits:
        return problems, saved
    want = {i for i, c in enumerate(params.canonical_slot_indices()) if c == i}
    records = entry["records"]
    for i in sorted(want - {int(k) for k in records}):
        problems.append(f"optimizer: {params.label(i)} has no saved state (missing entry)")
    slot_overrides = {i: {k: v for k, v in kv.items() if k != "lr_scale"} for i, kv in entry.get("per_slot", [])}
    for i in sorted(want & {int(k) for k in records}):
        try:  # the slot's own settings: a per-slot flag may give it another record (SGD momentum, AMSGrad)
            h = replace(saved.hyper, **slot_overrides[i]) if slot_overrides.get(i) else saved.hyper
        except Exception as e:  # the record's own check of a saved per-slot value
            problems.append(f"optimizer: {params.label(i)}: per-slot hyperparameters: {e}")
            continue
        kind = R.record_type(h, tuple(params[i].shape))  # Muon: by the slot's shape
        names = R.tensor_fields(kind)
        rec = records[str(i)]
        if rec["type"] != kind.__name__ or sorted(rec["tensors"]) != names:
            problems.append(f"optimizer: {params.label(i)}: state layout {rec['type']!r} {rec['tensors']!r}, "
                            f"expected {kind.__name__!r} {names!r}")
    return problems, saved


def load_checkpoint(
    path: PathLike, target, *, optimizer=None, restore_rng: bool = True,
    accept: Optional[Callable[[dict, dict], list[str]]] = None, follow_trainable: bool = False,
    host_state: bool = False, wanted: Optional[Callable] = None,
) -> Checkpoint:
    """Validate everything, then install the parameters and return the rest. A rejected
    load leaves parameters, mirrors, any optimizer state and the random generators
    untouched, and names every problem at once.

    Args:
        path: a checkpoint file, or a sharded checkpoint's folder.
        target: a ``Runner`` or a ``ParamList`` with the checkpoint's slots.
        optimizer: the optimizer whose history to restore (its kind and hyperparameters
            must match the saved ones); ``None``: parameters only.
        restore_rng: put the saved random generators back.
        accept: ``accept(manifest, tensors)`` returns the caller's own problems with the
            file (a resume that does not fit the run), checked with the rest.
        follow_trainable: (a Runner target; what a resume asks for) take the file's
            trainable set where it differs (the slots and the module's ``requires_grad``
            are set as saved); otherwise a different frozen mask is an error.
        host_state: keep the optimizer state in host memory even for a history on the
            device (a sharded resume moves only this rank's ranges there).
        wanted: of a sharded folder, read only the ranges of the pieced tensors this
            function names (``io/sharded.py``: a sharded resume's own ranges); the
            parameters so read are not installed but handed back (``Checkpoint.ranged``),
            the state's records hold the tensors as read (no copy).

    Returns:
        A ``Checkpoint``: the optimizer state, progress, loader state and moving average.

    Raises:
        CheckpointError: an unreadable, corrupt or ill-fitting file (every problem listed).
    """
    op = "load_checkpoint"
    path = Path(path)
    params = params_of(op, target)
    manifest, tensors, checked = read_checked(path, op, wanted)  # format, manifest, tensors, checksums
    follow = follow_trainable and callable(getattr(target, "follow_requires_grad", None))
    problems, saved_opt = _fit_problems(manifest, tensors, checked, params, optimizer, follow)  # the destination, once
    if accept is not None and not problems:
        problems = list(accept(manifest, tensors))
    raise_all(op, path, problems)
    # ---- everything checked; install
    if follow and list(checked.schema.requires_grad) != params.requires_grad_array():
        target.follow_requires_grad(checked.schema.requires_grad)
    ranged = set(manifest.get("ranged", ()))
    kept_out = {}
    for k, s in enumerate(params.storages()):
        if f"storage.{k}" in ranged:  # only the reader's ranges were read: handed back, not installed
            kept_out[k] = tensors[f"storage.{k}"]
            continue
        device = s.mirror.device if s.mirror is not None else None
        s.write_host(tensors[f"storage.{k}"])
        getattr(target, "unfilled", {}).pop(id(s.host), None)  # a released or meta-built tensor holds values now
        if device is not None:
            s.make_mirror(device)
    state = None
    if saved_opt is not None:
        state = _rebuild_state(manifest["optimizer"], tensors, params, saved_opt, host_state, ranged)
    rng = manifest.get("rng", {})
    if restore_rng and rng.get("torch"):
        torch.set_rng_state(tensors["rng.torch"])
    if restore_rng and rng.get("python") is not None:
        random.setstate((rng["python"]["version"], tuple(int(v) for v in tensors["rng.python"].tolist()),
                         rng["python"]["gauss"]))
    if restore_rng and rng.get("numpy") is not None:
        n = rng["numpy"]
        numpy.random.set_state(("MT19937", tensors["rng.numpy"].numpy().astype(numpy.uint32), n["pos"],
                                n["has_gauss"], n["gauss"]))
    if restore_rng and rng.get("cuda") and torch.cuda.is_available():
        for d in range(min(rng["cuda"], torch.cuda.device_count())):
            torch.cuda.set_rng_state(tensors[f"rng.cuda.{d}"], d)
    loader_state = loader_record(manifest, tensors)
    ema = None
    if manifest.get("ema") is not None:
        e = manifest["ema"]
        ema = {"decay": e["decay"], "count": e["count"], "values": {k: tensors[f"ema.{k}"] for k in e["storages"]}}
    averaged = None
    if manifest.get("averaged") is not None:
        averaged = {name: tensors[f"averaged.{name}"] for name in manifest["averaged"]}
    return Checkpoint(path, manifest, state, manifest.get("progress", {}), loader_state, ema, averaged, kept_out)


def _py_numpy_problems(rng: dict, tensors: dict) -> list[str]:
    """Python's and NumPy's saved states tried on throwaway generators: a state they refuse
    is said before anything is installed."""
    out = []
    for name, kind in (("python", "Python's random"), ("numpy", "NumPy's generator")):
        if rng.get(name) is not None:
            why = _mt_words_problem(tensors[f"rng.{name}"], with_index=name == "python")
            if why:
                out.append(f"rng: 'rng.{name}' is not a state {kind} can continue from ({why})")
    if out:
        return out
    if rng.get("python") is not None:
        try:
            random.Random().setstate((rng["python"]["version"], tuple(int(v) for v in tensors["rng.python"].tolist()),
                                      rng["python"]["gauss"]))
        except (ValueError, TypeError, OverflowError) as e:
            out.append(f"rng: 'rng.python' is not a state Python's random takes ({e})")
    if rng.get("numpy") is not None:
        n = rng["numpy"]
        try:
            numpy.random.RandomState().set_state(("MT19937", tensors["rng.numpy"].numpy().astype(numpy.uint32),
                                                  n["pos"], n["has_gauss"], n["gauss"]))
        except (ValueError, TypeError) as e:
            out.append(f"rng: 'rng.numpy' is not a state NumPy takes ({e})")
    return out


def _mt_words_problem(t: torch.Tensor, with_index: bool) -> Optional[str]:
    """Why a saved MT19937 state cannot be continued from, or ``None``: 624 words of 32
    bits (Python's also its index, 0..624, after them), not all zero (an all-zero state
    gives 0 forever). The generators themselves truncate or wrap a word out of range."""
    values = t.flatten().tolist()
    words = values[:624]
    if len(values) != 624 + with_index:
        return f"{len(values)} values, expected {624 + with_index}"
    bad = next((v for v in words if not 0 <= v < 2**32), None)
    if bad is not None:
        return f"a word out of the 32-bit range: {bad}"
    if with_index and not 0 <= values[624] <= 624:
        return f"its index {values[624]} is outside 0..624"
    if not any(words):
        return "every word is zero: it would draw 0 forever"
    return None


def loader_record(manifest: dict, tensors: dict) -> Optional[dict]:
    """A checkpoint's loader record as ``save_checkpoint`` was given it: a leantrain
    DataLoader's state with its ``order``, or a stream's position with its ``tensors``."""
    saved = manifest.get("loader")
    if not isinstance(saved, dict):
        return None
    if "kind" in saved:
        return dict(saved, tensors={name: tensors.get(f"loader.{name}") for name in saved.get("tensors", {})})
    if "loader.order" not in tensors:
        return None
    return dict(saved, order=tensors["loader.order"].tolist())


def _rebuild_state(entry: dict, tensors: dict, params: ParamList, opt, host: bool = False,
                   ranged: frozenset = frozenset()) -> OptState:
    native = entry["path"] == NATIVE
    reps = params.canonical_slot_indices()
    slots: list = [None] * len(params)
    for i, c in enumerate(reps):
        if c == i:
            rec = entry["records"][str(i)]
            s = params[i].storage
            like = s.mirror if native and s.mirror is not None and not host else s.host
            # the file holds logical values; the state takes the parameter's kernel layout
            kind = R.RECORDS[rec["type"]]
            # (a ranged tensor, read in part, is kept as read: its reader cuts its ranges from it)
            fields = {n: tensors[f"state.{i}.{n}"] if f"state.{i}.{n}" in ranged
                      else to_layout(tensors[f"state.{i}.{n}"], like) if R.parameter_shaped(kind, n)
                      else tensors[f"state.{i}.{n}"].to(like.device, copy=True).contiguous() for n in rec["tensors"]}
            slots[i] = R.RECORDS[rec["type"]](**fields, **rec["scalars"])
        elif c is not None and not native:
            slots[i] = slots[c]
    return OptState(opt.hyper, float(entry["lr"]), entry["path"], tuple(slots), int(entry["steps"]),
                    lrs=tuple(entry.get("lrs", ())), momenta=tuple(entry.get("momenta", ())),
                    bases=tuple(entry.get("bases", ())), overrides=saved_overrides(entry))


def saved_overrides(entry: dict) -> tuple:
    """A manifest's per-slot hyperparameters in ``OptState.overrides`` form."""
    return tuple((i, tuple(sorted(kv.items()))) for i, kv in entry.get("per_slot", []))
