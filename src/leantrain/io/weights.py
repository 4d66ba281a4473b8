"""Plain weights in and out: a PyTorch ``state_dict`` or a safetensors weights file.

Export gives every slot name (so ``module.load_state_dict`` works, ties included);
the safetensors file stores each storage once under its first name and records the
other names in its metadata (``aliases``), the way safetensors treats shared tensors.
Import matches by name, checks everything first and reports every mismatch at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch
from safetensors.torch import save_file

from .atomic import PathLike, atomic_write
from .tensorfile import TensorFile
from ..params.paramlist import params_of
from .checkpoint import current_value, dtype_name
from ..errors import CheckpointError, shape_str, slot_label


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


def save_weights(path: PathLike, target, *, ema: bool = False) -> Path:
    """Write a safetensors weights file: each storage once, aliases in the metadata
    (``ema=True``: the Runner's moving average of the weights)."""
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
    """Import a weights file written by ``save_weights`` (or any safetensors file) by name."""
    path = Path(path)
    op = "load_weights"
    with TensorFile(path, op) as f:
        weights = {k: f.read(k) for k in f.entries}
        meta = f.metadata
    try:
        aliases = json.loads(meta.get("aliases", "{}"))
    except (ValueError, RecursionError):
        aliases = None
    if not (isinstance(aliases, dict) and all(isinstance(v, str) for v in aliases.values())):
        raise CheckpointError(f"{op}: {path}: the alias map in the metadata is not a map of names")
    for alias, name in aliases.items():
        if name in weights:
            weights[alias] = weights[name]
    return import_state_dict(target, weights, strict=strict, op=f"load_weights: {path}")


def import_state_dict(
    target, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True, op: str = "import_state_dict"
) -> list[str]:
    """Write ``state_dict[name]`` into every slot with that name; returns the names
    not found (empty under ``strict``, where missing or extra names are errors).
    Aliased slots must receive equal values (they are one storage)."""
    params = params_of("import_state_dict", target)
    problems, plan = [], {}
    schema = params.schema()  # the names, shapes and dtypes the weights must match
    names = set(schema.names)
    for i, (v, name, shape, dtype) in enumerate(zip(params, schema.names, schema.shapes, schema.dtypes)):
        t = state_dict.get(name)
        where = slot_label(i, name)
        if t is None:
            if strict:
                problems.append(f"{where}: missing from the weights")
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
    extra = sorted(set(state_dict) - names)
    if strict:
        problems += [f"unexpected entry {n!r} (no slot has that name)" for n in extra]
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise CheckpointError(f"{op}: {len(problems)} problem(s), nothing was loaded:\n{lines}")
    for _, t, storage in plan.values():
        storage.write_host(t)
    return sorted(n for n in names if n not in state_dict) + extra
