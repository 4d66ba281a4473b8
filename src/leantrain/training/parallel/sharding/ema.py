"""The moving average of the weights under sharding: each rank averages its ranges.

``ShardedEMA`` keeps, per trainable storage, the average of this rank's range of it only
(the plan's cut of the storage's representative slot), so the average costs 1/W of the
weights per rank, like the optimizer state. It updates by the same rule as ``EMA`` (the
first update copies, then ``_foreach_lerp_``), on the same elements, so the averaged
values are the unsharded run's bits. Where the whole average is needed (an evaluation
with ``eval_ema``) it is all-gathered (every rank evaluates, so every rank joins);
``whole()`` gives an ``EMA`` again (the loop hands that to the runner when it ends);
a checkpoint stores each rank's ranges as pieces (``checkpoint.py``).

Under ``sharding="parameters"`` (``shards`` given) the weights between updates are this
rank's ranges only: the average reads them there (``ParameterShards.values``, the ranges
the optimizer just updated), and an evaluation of the average puts the average in their
place for its duration, so the units gather it as they gather the weights.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from . import comm
from ...runner.ema import EMA
from .plan import ShardPlan
from .state import own_range, working


class ShardedEMA(EMA):
    """``EMA`` over this rank's ranges: ``values[k]`` is the average of the range this
    rank owns of storage ``k`` (flat), ``None`` where it owns none (or before the first
    update)."""

    def __init__(self, params, decay: float, plan: ShardPlan, rank: int, count: int = 0,
                 values: Optional[list] = None, shards=None) -> None:
        super().__init__(params, decay, count, values)
        self.plan, self.rank, self.shards = plan, rank, shards
        index = {id(s): k for k, s in enumerate(params.storages())}
        self.ranges = {index[id(params[r.slot].storage)]: r for r in plan.owned(rank)}  # storage -> range

    @classmethod
    def cut(cls, params, saved: dict, plan: ShardPlan, rank: int, shards=None) -> "ShardedEMA":
        """A checkpoint's whole average (``Checkpoint.ema``, in host memory) cut to this
        rank's ranges, each copied to its storage's device."""
        out = cls(params, saved["decay"], plan, rank, saved["count"], shards=shards)
        storages = params.storages()
        for k, r in out.ranges.items():
            if k in saved["values"]:
                out.values[k] = own_range(saved["values"][k], r, storages[k].newest().device)
        return out

    def update(self, params) -> None:
        """Average in this rank's ranges of the current weights (device-side only)."""
        storages = params.storages()
        with torch.no_grad():
            if self.shards is not None:  # the parameters' memory is released: this rank's ranges are the weights
                pairs = [(k, self.shards.values[r]) for k, r in self.ranges.items()]
            else:
                pairs = [(k, storages[k].newest().detach().view(-1)[r.start: r.stop]) for k, r in self.ranges.items()]
            if self.count == 0:
                for k, w in pairs:
                    self.values[k] = w.clone()
            else:
                groups: dict = {}
                for k, w in pairs:
                    group = groups.setdefault((w.device, w.dtype), ([], []))
                    group[0].append(self.values[k]), group[1].append(w)
                for avgs, ws in groups.values():
                    torch._foreach_lerp_(avgs, ws, 1.0 - self.decay)
        self.count += 1

    def whole(self, params) -> EMA:
        """The whole average on every rank (a collective: every rank calls it)."""
        like = working(params)
        mine = {r: self.values[k] for k, r in self.ranges.items() if self.values[k] is not None}
        values: list = [None] * len(self.values)
        if self.count:
            index = {id(s): k for k, s in enumerate(params.storages())}
            for r, t in comm.all_gather_ranges(self.plan, self.rank, like, mine):
                k = index[id(params[r.slot].storage)]
                if values[k] is None:
                    values[k] = torch.empty_like(like[r.slot])
                values[k].view(-1)[r.start: r.stop] = t
        return EMA(params, self.decay, self.count, values)

    def storage_values(self, params) -> list[torch.Tensor]:
        return self.whole(params).storage_values(params)

    @contextlib.contextmanager
    def applied(self, params) -> Iterator[None]:
        if self.shards is None or self.shards.held:  # the module whole (the user's code): into its storages
            with self.whole(params).applied(params):
                yield
            return
        # parameter sharding: the average takes the place of this rank's ranges, which every
        # unit's gather reads, so the evaluation gathers it unit by unit (memory as in training)
        shards, saved = self.shards, []
        shards.release(shards.sharded)  # nothing resident keeps the trained values
        with torch.no_grad():
            for k, r in self.ranges.items():
                if self.values[k] is not None:
                    mine = shards.values[r]
                    saved.append((mine, mine.clone()))
                    mine.copy_(self.values[k])
        try:
            yield
        finally:
            shards.release(shards.sharded)
            with torch.no_grad():
                for mine, old in saved:
                    mine.copy_(old)
