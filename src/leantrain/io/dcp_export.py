"""A checkpoint's model as a ``torch.distributed.checkpoint`` (DCP) folder.

The state dict is the plain module's: one entry per slot, by the module's own names
(``model.state_dict()``'s keys: parameters, tied names included, then persistent
buffers), whatever engine, world size or sharding wrote the checkpoint. That is what
torchtitan and Lightning's FSDP strategy read, and
``torch.distributed.checkpoint.load(model.state_dict(), checkpoint_id=folder)`` fills a
plain model from it without a process group. Whole or nothing: the folder is written
beside its place and renamed into it; an existing folder with files is never written into.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Union

from ..errors import CheckpointError
from .exporting import params_from_checkpoint

PathLike = Union[str, os.PathLike]


def model_state(src: PathLike, op: str = "export_dcp", ema: bool = False) -> dict:
    """The checkpoint's model as ``{name: tensor}``, the module's names (``ema``: the moving average)."""
    params = params_from_checkpoint(src, op, ema=ema)
    state, shared = {}, {}
    for i, p in enumerate(params):
        if not p.name:
            raise CheckpointError(f"{op}: {src}: slot {i} has no name (a checkpoint of a parameter list, not of a "
                                  f"module): a DCP state dict needs the module's names")
        key = id(p.storage)
        if key not in shared:  # a tie: one tensor under each of its names, as model.state_dict() has it
            shared[key] = p.value()
        state[p.name] = shared[key]
    return state


def export_dcp(src: PathLike, out: PathLike, ema: bool = False, op: str = "export") -> Path:
    """Write the checkpoint ``src``'s model as a DCP folder at ``out`` (which must not exist,
    or be an empty folder). Returns ``out``."""
    import torch.distributed.checkpoint as dcp

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{op}: {out} already exists{' and holds files' if out.is_dir() else ' as a file'}: "
                              f"a DCP export writes a folder of its own; give a new path")
    state = model_state(src, op, ema)  # read and checked before anything is written
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.leantrain-dcp-{os.getpid()}-{time.time_ns()}")  # new: this call's own
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, checkpoint_id=str(tmp))
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


__all__ = ["export_dcp", "model_state"]
