"""Saving a sharded run: every rank writes its file, then rank 0 the index (``io/sharded.py``).

Every rank calls ``save_sharded`` at the same step (a collective): the generation name
and the records' scalars are agreed first, then each rank writes the state pieces it
owns; rank 0 adds what all ranks hold whole (parameters, buffers, moving average,
generator and loader states) and, once every rank's file is on disk, the index.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from .. import distributed
from .plan import ShardPlan
from ....io.checkfile import checksum
from ....io.checkpoint import contents, model_config_text
from ....io.sharded import check_folder, generation_marked, write_index, write_shard
from ....optim import OptState
from ....optim.records import record_scalars


def save_sharded(path, runner, plan: ShardPlan, rank: int, state: OptState, *, progress: dict,
                 loader_state: Optional[dict], ema, values: Optional[dict] = None,
                 identity: Optional[dict] = None) -> Path:
    """Write a sharded checkpoint of a sharded run into the folder ``path`` (``ema``: the
    run's ``ShardedEMA``, or ``None``; ``values``: parameter sharding's owned ranges of the
    parameters, which their owners write as pieces of their storages)."""
    op = "save_checkpoint"
    folder = check_folder(op, path)
    folder.mkdir(parents=True, exist_ok=True)
    proposed = f"g{int(progress.get('step', 0)) % 10**8:08d}-{os.urandom(4).hex()}"
    with generation_marked(folder, proposed) if rank == 0 else contextlib.nullcontext():
        _save(folder, runner, plan, rank, state, progress, loader_state, ema, proposed, values, identity)
    return folder


def _save(folder, runner, plan: ShardPlan, rank: int, state: OptState, progress: dict, loader_state, ema,
          proposed: str, values: Optional[dict], identity: Optional[dict] = None) -> None:
    op, world = "save_checkpoint", plan.world
    generation = distributed.everyone(proposed)[0]  # rank 0's, marked in flight before any shard is written
    owned = [r for r in plan.owned(rank) if state.slots[r.slot] is not None]
    mine = {str(r.slot): {"type": type(state.slots[r.slot]).__name__, "scalars": record_scalars(state.slots[r.slot]),
                          "tensors": sorted(state.slots[r.slot].tensors())} for r in owned}
    records: dict = {}
    for part in distributed.everyone(mine):
        for k, entry in part.items():
            records.setdefault(k, entry)
    pieces = {(f"state.{r.slot}.{k}", r.start): t for r in owned for k, t in state.slots[r.slot].tensors().items()}
    if ema is not None and ema.count:  # the moving average: each rank's ranges, as pieces
        pieces.update({(f"ema.{k}", r.start): ema.values[k] for k, r in ema.ranges.items()})
    pieced: frozenset = frozenset()
    if values is not None:  # each owner writes its ranges of the parameters (host copies: a file holds them)
        index = {id(s): k for k, s in enumerate(runner.params.storages())}
        of = {r.slot: index[id(runner.params[r.slot].storage)] for r in plan.ranges}
        pieced = frozenset(of.values())
        pieces.update({(f"storage.{of[r.slot]}", r.start): v.detach().to("cpu") for r, v in values.items()})
    whole, manifest = {}, None
    if rank == 0:
        manifest, whole = contents(op, runner.params, state, progress, loader_state, True, None, records=records,
                                   pieced=pieced, identity=identity,
                                   model_config=model_config_text(op, runner))
        if ema is not None:
            manifest["ema"] = {"decay": ema.decay, "count": ema.count, "storages": ema.trainable if ema.count else []}
        manifest["checksums"] = {n: checksum(t) for n, t in whole.items()}
    files = distributed.everyone(write_shard(folder, generation, rank, world, whole, pieces))
    if rank == 0:
        write_index(folder, manifest, world, generation, sorted(files, key=lambda f: f["rank"]))
    if world > 1:
        dist.barrier(group=distributed.group())  # the index is written before any rank goes on
