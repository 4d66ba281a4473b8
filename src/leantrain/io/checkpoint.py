"""Checkpoints: one safetensors file holding weights, optimizer state, progress and RNG.

Why one file: a single ``rename`` then replaces everything at once, so a crash can
never pair new weights with old optimizer state. The safetensors header carries a
JSON manifest (metadata key ``leantrain``): format and version, the slot schema
(names, shapes, dtypes, trainability, alias map), the optimizer (kind,
hyperparameters, path, per-representative record scalars), progress, loader state
and a checksum per tensor (CRC-32C from format version 2; version 1's CRC-32 is still read). Each storage is written once (``storage.K``); aliases
point at it through the schema. Loading is strict: every problem is collected and
reported at once, and nothing is installed unless there is none.
"""

from __future__ import annotations

import json
import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import numpy
import torch
from safetensors.torch import save_file

from .atomic import PathLike, atomic_write, checked_path
from . import checkfile
from .checkfile import FORMAT, VERSION, checksum, seal
from .sharded import read_folder
from .manifest import DTYPE_NAMES, LOADER_NAME, check_json
from ..errors import CheckpointError
from ..optim import OptState
from ..optim import rules as R
from ..params.paramlist import ParamList, params_of

def read_checked(path: PathLike, op: str, wanted=None):
    """A checkpoint read whole and checked (``checkfile.read_checked``): a file, or a
    sharded folder (``sharded.read_folder``: its pieces verified and put together, or
    only the ranges ``wanted`` names)."""
    path = checked_path(op, path)
    return read_folder(path, op, wanted) if path.is_dir() else checkfile.read_checked(path, op)


def read_checkpoint(path: PathLike, op: str = "read_checkpoint") -> tuple[dict, dict[str, torch.Tensor]]:
    """The manifest and every tensor of a checkpoint file or sharded folder, checked whole
    (format, manifest, tensor list, checksums) before anything uses them."""
    manifest, tensors, _ = read_checked(path, op)
    return manifest, tensors


def model_config_text(op: str, target) -> Optional[str]:
    """The Hugging Face config of a Runner's module as ``save_pretrained`` writes it
    (``config.to_json_string()``), or ``None`` when the module has none: what a checkpoint
    keeps so that an export can write ``config.json`` from data, never importing code."""
    config = getattr(getattr(target, "module", None), "config", None)
    if config is None or not callable(getattr(config, "to_json_string", None)):
        return None
    try:
        text = config.to_json_string()
        data = json.loads(text)
    except Exception as e:  # the config's own code: any failure, before a byte is written
        raise CheckpointError(f"{op}: the model's config cannot be written as JSON ({type(e).__name__}: {e}); "
                              f"nothing was written") from None
    if isinstance(data, dict) and not data.get("architectures"):  # save_pretrained names the model's class
        data["architectures"] = [type(target.module).__name__]
        text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    return text


def current_value(storage) -> torch.Tensor:
    """The newest value of a storage on the CPU, without changing who is current."""
    # Intentional device-to-host read: a checkpoint is a request for current values.
    return storage.newest().detach().to("cpu")


# ------------------------------------------------------------------------ save
def save_checkpoint(
    path: PathLike,
    target,
    *,
    state: Optional[OptState] = None,
    progress: Optional[dict] = None,
    loader_state: Optional[dict] = None,
    rng: bool = True,
    ema=None,
    identity: Optional[dict] = None,
    averaged: Optional[dict] = None,
) -> Path:
    """Write ``target``'s parameters, and optionally its training state, to ``path``
    atomically (a scratch file, fsynced, renamed over ``path``; a crash leaves the old
    file). One safetensors file: each storage once, the schema, ties and frozen mask in
    a sealed manifest, a CRC-32C per tensor.

    Args:
        path: the file to write (its folder must exist).
        target: a ``Runner`` or a ``ParamList``.
        state: an optimizer history to save with the parameters.
        progress: a loop's progress record (the loops write it).
        loader_state: a loader's position (the loops write it).
        rng: save the random generators' states.
        ema: a moving average of the weights (an ``EMA``).
        averaged: a torch ``AveragedModel``'s state (``Averaging.tensors()``), named.
        identity: who wrote the file (the loops: ``{"run": run id, "file": file id}``),
            what a folder of kept checkpoints checks before it deletes or loads it.

    Returns:
        The path written.

    Raises:
        CheckpointError: a path that cannot be written (the OS's reason; the old file stays).
    """
    op = "save_checkpoint"
    params = params_of(op, target)
    path = check_destination(op, path)
    manifest, tensors = contents(op, params, state, progress, loader_state, rng, ema, identity=identity,
                                 model_config=model_config_text(op, target))
    if averaged is not None:
        manifest["averaged"] = {name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                                for name, t in averaged.items()}
        tensors.update({f"averaged.{name}": t for name, t in averaged.items()})
    names = sorted(tensors)
    with ThreadPoolExecutor(max_workers=2) as pool:  # the checksum releases the GIL
        sums = list(pool.map(lambda n: checksum(tensors[n]), names))
    manifest["checksums"] = dict(zip(names, sums))
    meta = {"leantrain": seal(json.dumps(manifest, sort_keys=True))}

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp), metadata=meta)

    return atomic_write(path, write, op)


def contents(op: str, params: ParamList, state: Optional[OptState], progress: Optional[dict],
             loader_state: Optional[dict], rng: bool, ema, records: Optional[dict] = None,
             pieced: frozenset = frozenset(), identity: Optional[dict] = None,
             model_config: Optional[str] = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """A checkpoint's manifest (without checksums) and tensors. ``records``: the
    optimizer's record entries given whole (a sharded save: the state tensors are
    written by their owners, not put in ``tensors``); ``pieced``: the storages whose
    values their owners write in pieces (parameter sharding)."""
    for what, value in (("progress", progress), ("loader_state", loader_state)):
        if value is not None and not isinstance(value, dict):
            raise CheckpointError(f"{op}: {what} must be a dict, got {type(value).__name__}")
        why = check_json(op, what, value if what == "progress" or value is None
                         else {k: v for k, v in value.items() if k != "tensors"})
        if why is not None:
            raise CheckpointError(why)
    loader_tensors = _loader_tensors(op, loader_state)
    schema = params.schema()
    tensors: dict[str, torch.Tensor] = {}
    for k, s in enumerate(params.storages()):
        if k not in pieced:
            tensors[f"storage.{k}"] = current_value(s).contiguous()
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "slots": schema.slots_manifest(),
        "representatives": schema.representatives_list(),
        "optimizer": None,
        "progress": progress or {},
        "loader": None,
        "rng": {"torch": False, "cuda": 0},
    }
    if identity is not None:
        manifest["identity"] = dict(identity)
    if model_config is not None:  # a Hugging Face model's config.json text (an export writes it)
        manifest["model_config"] = model_config
    if state is not None:
        if not isinstance(state, OptState) or len(state.slots) != len(params):
            raise CheckpointError(
                f"{op}: the optimizer state does not fit the {len(params)} slots"
            )
        manifest["optimizer"] = _state_manifest(state, tensors, params, records)
    if loader_state is not None:
        manifest["loader"] = {k: v for k, v in loader_state.items() if k not in ("order", "tensors")}
        if "kind" in loader_state:  # a stream's position (training/loops/streams.py): JSON and named tensors
            manifest["loader"]["tensors"] = {name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                                             for name, t in loader_tensors.items()}
        for name, t in loader_tensors.items():
            tensors[f"loader.{name}"] = t
    if ema is not None:
        kept = [k for k in ema.trainable if ema.values[k] is not None]
        manifest["ema"] = {"decay": ema.decay, "count": ema.count, "storages": kept}
        for k in kept:
            # Intentional device-to-host read of the averages: saving asks for them.
            tensors[f"ema.{k}"] = ema.values[k].detach().to("cpu").contiguous()
    if rng:
        tensors["rng.torch"] = torch.get_rng_state()
        manifest["rng"]["torch"] = True
        # Python's and NumPy's global generators (collates and transforms draw from them),
        # this process's: their word arrays as tensors, their scalars in the manifest
        version, words, gauss = random.getstate()
        tensors["rng.python"] = torch.tensor(words, dtype=torch.int64)
        manifest["rng"]["python"] = {"version": version, "gauss": gauss}
        _, keys, pos, has_gauss, cached = numpy.random.get_state()
        tensors["rng.numpy"] = torch.from_numpy(keys.astype(numpy.int64))
        manifest["rng"]["numpy"] = {"pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(cached)}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for d, st in enumerate(torch.cuda.get_rng_state_all()):
                tensors[f"rng.cuda.{d}"] = st
            manifest["rng"]["cuda"] = torch.cuda.device_count()
    return manifest, tensors


def check_destination(op: str, path: object) -> Path:
    """``path`` as a file path that can be written (not empty, not a folder)."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise CheckpointError(f"{op}: expected a file path, got {path!r}")
    path = checked_path(op, path)
    if path.is_dir():
        raise CheckpointError(f"{op}: {path}: is a folder; give a file path inside it")
    return path


def _loader_tensors(op: str, loader_state: Optional[dict]) -> dict[str, torch.Tensor]:
    """The tensors a loader record stores: a leantrain DataLoader's order, or a stream's
    named tensors (generator states, tensors of a ``state_dict``) on the CPU."""
    if loader_state is None:
        return {}
    if "kind" not in loader_state:
        order = loader_state.get("order")
        if not (isinstance(order, (list, tuple)) and all(isinstance(o, int) and not isinstance(o, bool) for o in order)):
            raise CheckpointError(f"{op}: loader_state['order'] must be a list of item indices")
        return {"order": torch.tensor(list(order), dtype=torch.int64)}
    named = loader_state.get("tensors", {})
    if not (isinstance(named, dict) and all(isinstance(k, str) and LOADER_NAME.fullmatch(k) and isinstance(t, torch.Tensor)
                                            and t.dtype in DTYPE_NAMES.values() for k, t in named.items())):
        raise CheckpointError(f"{op}: loader_state['tensors'] must map names ([A-Za-z0-9_.]) to tensors")
    return {k: t.detach().to("cpu").contiguous() for k, t in named.items()}


def _state_manifest(state: OptState, tensors: dict, params: ParamList, given: Optional[dict] = None) -> dict:
    records = {} if given is None else given
    reps = params.canonical_slot_indices()
    for i, rec in enumerate(state.slots if given is None else ()):
        if rec is None or reps[i] != i:
            continue  # aliases share their representative's record; frozen slots own none
        entry = {"type": type(rec).__name__, "scalars": R.record_scalars(rec), "tensors": sorted(rec.tensors())}
        for name, t in rec.tensors().items():
            # Intentional device-to-host read of optimizer state: saving asks for it.
            tensors[f"state.{i}.{name}"] = t.detach().to("cpu").contiguous()
        records[str(i)] = entry
    h = state.hyper
    entry = {
        "kind": h.kind,
        "hyper": h.as_dict(),
        "lr": state.lr,
        "path": state.path,
        "steps": state.steps,
        "records": records,
    }
    if state.overrides:  # only then: default checkpoints keep their exact bytes
        entry["per_slot"] = [[i, dict(kv)] for i, kv in state.overrides]
    for name in ("lrs", "momenta", "bases"):  # param groups' rates, a cycled momentum: only when set
        if getattr(state, name):
            entry[name] = list(getattr(state, name))
    return entry

