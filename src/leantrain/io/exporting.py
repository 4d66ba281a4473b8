"""A checkpoint read without its model, for exporting it: the parameter list it
describes (slots, names, frozen flags, ties) holding the saved values, the optimizer it
records, and one checkpoint file made from a sharded folder (what ``leantrain export``
uses)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from safetensors.torch import save_file

from .atomic import PathLike, atomic_write
from .checkfile import seal
from .checkpoint import read_checked, read_checkpoint
from ..errors import CheckpointError
from ..optim import Optimizer
from ..optim import rules as R
from ..params.param import Param
from ..params.paramlist import ParamList
from ..params.schema import ParameterSchema
from ..params.storage import Storage


def consolidate(src: PathLike, out: PathLike, op: str = "export") -> Path:
    """A checkpoint (a sharded folder, or a file) written as one checkpoint file: every
    piece verified and put together first; the file is the one an unsharded run writes."""
    manifest, tensors, _ = read_checked(src, op)
    meta = {"leantrain": seal(json.dumps(manifest, sort_keys=True))}

    def write(tmp: Path) -> None:
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp), metadata=meta)

    return atomic_write(Path(out), write, op)


def params_from_checkpoint(path: PathLike, op: str = "params_from_checkpoint", *, ema: bool = False) -> ParamList:
    """The parameter list a checkpoint describes (its slots, names, frozen flags and ties),
    holding the saved values (``ema=True``: the saved moving average where there is one):
    what exporting a checkpoint needs without the model."""
    manifest, tensors = read_checkpoint(path, op)
    if ema:
        if manifest.get("ema") is None:
            raise CheckpointError(f"{op}: {path}: the checkpoint holds no moving average (train with ema_decay)")
        for k in manifest["ema"]["storages"]:
            tensors[f"storage.{k}"] = tensors[f"ema.{k}"]
    try:
        schema = ParameterSchema.from_manifest(manifest.get("slots"), manifest.get("representatives"))
        storages: dict[int, Storage] = {}
        views = []
        for i in range(len(schema)):
            k = schema.storages[i]
            storage = storages.get(k)
            if storage is None:
                storage = storages[k] = Storage(tensors[f"storage.{k}"].clone())
            views.append(Param.of_storage(storage, requires_grad=schema.requires_grad[i], name=schema.names[i]))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{op}: {path}: malformed manifest ({type(e).__name__}: {e})") from None
    return ParamList(views)


def optimizer_of(manifest: dict) -> Optional[Optimizer]:
    """The optimizer a checkpoint manifest records (with its saved rate), or ``None``."""
    entry = manifest.get("optimizer")
    if not entry:
        return None
    hyper = R.HYPERS[entry["kind"]](**entry["hyper"])
    return Optimizer(hyper)
