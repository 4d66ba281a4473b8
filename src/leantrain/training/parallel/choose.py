"""Which ``Strategy`` (and so which ``Reduction``) a loop or a call runs with, chosen
once when it starts: the only place that asks whether a process group is running.

No process group: one process (a ``Strategy``, whose reduction is
``update.reduction.ONE_PROCESS``), unless the settings ask for sharding (a one-rank
plan). Under ``torch.distributed``: sharded when the config shards, else data parallel
(overlapped, or exact with ``exact_reduction``; ``local`` when each rank reads its own
items, ``rank_data.rank_local``); with ``engine="ddp"``, torch's DDP reduces the gradients
(``torch_ddp.py``); with ``engine="fsdp2"``, torch's ``fully_shard`` runs the items
(``torch_fsdp2.py``; one process: parameter sharding's one-rank plan, whose checkpoint is
a folder as the ranks' is).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from . import distributed
from .data_parallel import DataParallelStrategy
from .engines import FSDP2, torch_engine
from .sharding.strategy import ShardedStrategy
from .torch_ddp import DDPStrategy
from .torch_fsdp2 import FSDP2Strategy
from .strategy import ONE_PROCESS, ONE_PROCESS_RUN, ParallelOptions, Strategy


def choose(settings: Optional[ParallelOptions] = None, *, local: bool = False) -> Strategy:
    """The strategy for a loop with these settings (a loop config's ``parallel``; ``None``:
    a public one-update call, which uses its ``.reduction``)."""
    if settings is None:
        return ONE_PROCESS_RUN if distributed.active() is None else DataParallelStrategy(ParallelOptions())
    if settings.sharding is not None:
        return ShardedStrategy(settings, local)
    if distributed.active() is None:
        if isinstance(settings.engine, FSDP2):  # nothing to shard: parameter sharding's one-rank plan, the
            # one-process bits, and a checkpoint folder, as every engine="fsdp2" run writes (a resume reads it)
            return ShardedStrategy(replace(settings, engine="leantrain", sharding="parameters"), local)
        return Strategy(ONE_PROCESS, settings)  # DDP: one process has nothing to reduce
    if isinstance(settings.engine, FSDP2):
        return FSDP2Strategy(settings, local)
    if torch_engine(settings.engine):
        return DDPStrategy(settings, local)
    return DataParallelStrategy(settings, local)
