"""Which ``Strategy`` (and so which ``Reduction``) a loop or a call runs with, chosen
once when it starts: the only place that asks whether a process group is running.

No process group: one process (``strategy.ONE_PROCESS_RUN``, whose reduction is
``update.reduction.ONE_PROCESS``), unless the config asks for sharding (a one-rank
plan). Under ``torch.distributed``: sharded when the config shards, else data parallel
(overlapped, or exact with ``exact_reduction``; ``local`` when each rank reads its own
items, ``rank_data.rank_local``).
"""

from __future__ import annotations

from . import distributed
from .data_parallel import DataParallelStrategy
from .sharding.strategy import ShardedStrategy
from .strategy import ONE_PROCESS_RUN, Strategy


def choose(cfg=None, *, local: bool = False) -> Strategy:
    """The strategy for a loop with config ``cfg`` (``None``: a public one-update call,
    which uses its ``.reduction``)."""
    sharding = getattr(cfg, "sharding", None)
    exact = bool(getattr(cfg, "exact_reduction", False))
    if sharding is not None:
        return ShardedStrategy(exact, local)
    if distributed.active() is None:
        return ONE_PROCESS_RUN
    return DataParallelStrategy(exact, local)
