"""Which ``Reduction`` a loop or a call runs with, chosen once when it starts.

No process group: one process (``update.reduction.ONE_PROCESS``), unless the config
asks for sharding (a one-rank plan). Under ``torch.distributed``: ``Sharded`` when the
config shards, else ``DataParallel`` (overlapped, or exact with ``exact_reduction``;
``local`` when each rank reads its own items, ``rank_data.rank_local``).
"""

from __future__ import annotations

from ..update.reduction import ONE_PROCESS, Reduction
from . import distributed
from .data_parallel import DataParallel
from .sharding.reduction import Sharded


def choose(cfg=None, *, local: bool = False) -> Reduction:
    """The reduction for a loop with config ``cfg`` (``None``: a public one-update call)."""
    sharding = getattr(cfg, "sharding", None)
    exact = bool(getattr(cfg, "exact_reduction", False))
    if sharding is not None:
        return Sharded(exact, local)
    if distributed.active() is None:
        return ONE_PROCESS
    return DataParallel(exact, local)
