"""Plain weights in and out: a PyTorch ``state_dict`` or a safetensors weights file.

Export gives every slot name (so ``module.load_state_dict`` works, ties included);
the safetensors file stores each storage once under its first name and records the
other names in its metadata (``aliases``), the way safetensors treats shared tensors.
Import matches by name, checks everything first and reports every mismatch at once.

Hugging Face folders both ways: ``save_weights(folder, runner, pretrained=True)`` writes
``model.safetensors`` (ties stored once, as ``save_pretrained`` does) and the model's
``config.json`` when it has one, a folder ``from_pretrained`` loads; ``load_weights``
reads such a folder, a sharded one (``model.safetensors.index.json`` and its shards) or
a single file, and takes a tied name that is absent as given by its representative's
(what ``save_pretrained`` leaves out), strict otherwise.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Mapping, Optional

import torch
from safetensors.torch import save_file

from .atomic import PathLike, atomic_write, atomic_write_bytes, checked_path
from .tensorfile import TensorFile
from ..params.paramlist import params_of
from .checkfile import dtype_name
from .checkpoint import current_value, model_config_text
from ..errors import CheckpointError, shape_str, slot_label

__all__ = ["export_state_dict", "import_state_dict", "save_weights", "load_weights", "read_weights"]


def export_state_dict(target, *, ema: bool = False) -> dict[str, torch.Tensor]:
    """``{slot name: current value}`` on the CPU; aliased names share one tensor.
    ``ema=True``: the moving average a Runner trained with ``ema_decay`` keeps instead
    (frozen slots and buffers: their value)."""
    params = params_of("export_state_dict", target)
    if ema:
        average = getattr(target, "ema", None)
        if average is None:
            raise CheckpointError("export_state_dict: ema=True needs a Runner that keeps a moving average "
                                  "(train with ema_decay)")
        # Intentional device-to-host reads: exporting asks for the values.
        values = {id(s): t.detach().to("cpu") for s, t in zip(params.storages(), average.storage_values(params))}
    else:
        values = {id(s): current_value(s) for s in params.storages()}
    out = {}
    for i, v in enumerate(params):
        if not v.name:
            raise CheckpointError(f"export_state_dict: {slot_label(i, None)} has no name")
        out[v.name] = values[id(v.storage)]
    return out


def save_weights(path: PathLike, target, *, ema: bool = False, pretrained: bool = False,
                 config: Optional[str] = None, name: str = "model.safetensors") -> Path:
    """Write a safetensors weights file: each storage once, aliases in the metadata
    (``ema=True``: the Runner's moving average of the weights). ``pretrained=True``:
    ``path`` is a folder; it gets ``model.safetensors`` and ``config.json`` (``config``,
    the JSON text of a Hugging Face config, or by default the Runner's module's
    ``config`` as ``save_pretrained`` writes it): a folder ``from_pretrained`` loads,
    ties kept (``name``: the weights file's name in it, ``model.safetensors`` for that). Whole or nothing: when either file cannot be written, the folder keeps
    what it held. Returns the weights file written."""
    if pretrained:
        op = "save_weights"
        folder = checked_path(op, path)
        if folder.exists() and not folder.is_dir():
            raise CheckpointError(f"{op}: {folder}: is a file; pretrained=True writes a folder")
        params_of(op, target)  # checked before the folder is made
        text = model_config_text(op, target) if config is None else config  # made before anything is written
        if text is not None and (folder / "config.json").is_dir():
            raise CheckpointError(f"{op}: {folder / 'config.json'}: is a folder; nothing was written")
        old = (folder / "config.json").read_bytes() if (folder / "config.json").is_file() else None
        if text is not None:
            atomic_write_bytes(folder / "config.json", text.encode(), op)
        try:
            written = save_weights(folder / name, target, ema=ema)
        except BaseException:
            if text is not None:  # the folder as it was: the earlier config (or none) beside the earlier weights
                if old is None:
                    (folder / "config.json").unlink(missing_ok=True)
                else:
                    atomic_write_bytes(folder / "config.json", old, op)
            raise
        if name == "model.safetensors":
            _remove_replaced_shards(folder)
        return written
    params = params_of("save_weights", target)
    first: dict[int, str] = {}
    tensors, aliases = {}, {}
    for name, t in export_state_dict(target, ema=ema).items():
        s = next(v.storage for v in params if v.name == name)
        if id(s) in first:
            aliases[name] = first[id(s)]
        else:
            first[id(s)] = name
            tensors[name] = t.contiguous()
    meta = {"format": "pt", "aliases": json.dumps(aliases, sort_keys=True)}
    return atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta), "save_weights")


def load_weights(path: PathLike, target, *, strict: bool = True) -> list[str]:
    """Import weights by name: a file written by ``save_weights`` (or any safetensors
    file), a folder holding ``model.safetensors``, or a sharded Hugging Face checkpoint
    (a folder with ``model.safetensors.index.json``, or that index file)."""
    op = "load_weights"
    path = checked_path(op, path)
    return import_state_dict(target, read_weights(op, path), strict=strict, op=f"load_weights: {path}")


def read_weights(op: str, path: PathLike) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of a weights file or folder (see ``load_weights``), each a view
    of its file's mapping: nothing is read until used, and then only the pages used. A
    name the alias metadata gives is its representative's tensor."""
    path = checked_path(op, path)
    weights, aliases = {}, {}
    for file in _weight_files(op, path):
        with TensorFile(file, op) as f:
            for k in f.entries:
                if k in weights:
                    raise CheckpointError(f"{op}: {file}: tensor {k!r} is in two shards")
                weights[k] = f.read(k)
            meta = f.metadata
        try:
            found = json.loads(meta.get("aliases", "{}"))
        except (ValueError, RecursionError):
            found = None
        if not (isinstance(found, dict) and all(isinstance(v, str) for v in found.values())):
            raise CheckpointError(f"{op}: {file}: the alias map in the metadata is not a map of names")
        aliases.update(found)
    for alias, name in aliases.items():
        if name in weights:
            weights[alias] = weights[name]
    return weights


HF_SHARD = re.compile(r"model-[0-9]{5}-of-[0-9]{5}\.safetensors")


def _remove_replaced_shards(folder: Path) -> None:
    """After a folder's ``model.safetensors`` is written: the sharded format it replaces
    goes (its index, then the shards the index names that are files of the usual
    ``model-NNNNN-of-NNNNN.safetensors`` names), so no reader finds the old weights."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file() or index.is_symlink():
        return
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
        shards = set(weight_map.values()) if isinstance(weight_map, dict) else set()
    except (OSError, ValueError, RecursionError, AttributeError, TypeError):
        shards = set()
    index.unlink()
    for name in shards:
        p = folder / name if isinstance(name, str) and HF_SHARD.fullmatch(name) else None
        if p is not None and p.is_file() and not p.is_symlink():
            p.unlink()


def _weight_files(op: str, path: Path) -> list[Path]:
    """The safetensors files ``path`` names: itself, a folder's ``model.safetensors`` (first,
    as ``from_pretrained`` prefers it), or the shards a ``model.safetensors.index.json``
    lists (each once, in order)."""
    index = path / "model.safetensors.index.json" if path.is_dir() else path
    if path.is_dir() and (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    if path.is_dir() and not index.is_file():
        raise CheckpointError(f"{op}: {path}: a folder without model.safetensors or model.safetensors.index.json")
    if index.name.endswith(".index.json"):
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (OSError, ValueError, RecursionError, AttributeError) as e:
            raise CheckpointError(f"{op}: {index}: not a safetensors index ({type(e).__name__})") from None
        if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
            raise CheckpointError(f"{op}: {index}: its weight_map is not a map of names to shard files")
        shards = list(dict.fromkeys(weight_map.values()))
        bad = [s for s in shards if Path(s).name != s or s in ("", ".", "..") or (index.parent / s).is_symlink()]
        if bad:
            raise CheckpointError(f"{op}: {index}: shard names must be files beside the index (no folder, no "
                                  f"symlink), got {bad[:3]}")
        return [index.parent / s for s in shards]
    return [path]


def import_state_dict(
    target, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True, op: str = "import_state_dict"
) -> list[str]:
    """Write ``state_dict[name]`` into every slot with that name; returns the names
    not found (empty under ``strict``, where missing or extra names are errors).
    Aliased slots must receive equal values (they are one storage); an alias that is
    absent takes its storage's value from the names present."""
    params = params_of("import_state_dict", target)
    problems, plan = [], {}
    schema = params.schema()  # the names, shapes and dtypes the weights must match
    names = set(schema.names)
    missing = []
    for i, (v, name, shape, dtype) in enumerate(zip(params, schema.names, schema.shapes, schema.dtypes)):
        t = state_dict.get(name)
        where = slot_label(i, name)
        if t is None:
            missing.append((i, v, name))
            continue
        if not isinstance(t, torch.Tensor):
            problems.append(f"{where}: expected a tensor, got {type(t).__name__}")
        elif tuple(t.shape) != shape or dtype_name(t.dtype) != dtype:
            problems.append(
                f"{where}: expected {shape_str(shape)} {dtype}, got "
                f"{shape_str(t.shape)} {dtype_name(t.dtype)}"
            )
        elif id(v.storage) in plan and not torch.equal(plan[id(v.storage)][1], t):
            problems.append(f"{where}: is tied to {plan[id(v.storage)][0]} but the weights differ")
        else:
            plan.setdefault(id(v.storage), (where, t, v.storage))
    # A name that is absent is given by its storage's other names (a tie saved once, as
    # save_pretrained leaves lm_head.weight out); a storage no name gives is missing.
    absent = [(i, name) for i, v, name in missing if id(v.storage) not in plan]
    if strict:
        problems += [f"{slot_label(i, name)}: missing from the weights" for i, name in absent]
    extra = sorted(set(state_dict) - names)
    if strict:
        problems += [f"unexpected entry {n!r} (no slot has that name)" for n in extra]
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise CheckpointError(f"{op}: {len(problems)} problem(s), nothing was loaded:\n{lines}")
    for _, t, storage in plan.values():
        storage.write_host(t)
    return sorted(name for _, name in absent) + extra
