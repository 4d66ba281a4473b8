"""Sharding's reduction (ZeRO stages 1, 2 and 3): the ``Sharded`` update seam, which the
``ShardedStrategy`` (``strategy.py``) installs its plan in when the run starts.

The update's items are shared as data parallel shares them; the ranks' sums are then
reduce-scattered by the shard plan (``step.py``), each rank updates the ranges it owns
with the optimizer's own rules and gathers the rest. The run's history holds this
rank's ranges only (``state.py``), its moving average too (``ema.py``), and every rank
writes its pieces of a checkpoint folder (``checkpoint.py``). With ``exact`` the mean
is data parallel's exact fold (the one-process bits). ``"parameters"`` also releases the
parameters' memory between uses (``gathering.py``), takes each item's gradient to the
owners during its backward in item order (``rounds.py``: the one-process bits, exact or
not) and updates the owned ranges without gathering them. A sharded loop in one process
(no process group) runs the same plan with one rank.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...runner.runner import Runner
from ...update.mean import Mean, sum_items
from ...update.reduction import Reduction, clipped, skipping
from ...update.vectorized import stacked_loss_and_gradients
from .. import distributed
from ..data_parallel import DataParallel
from . import comm, step as shard_step
from .gathering import ParameterShards
from .overlap import overlapped_ranges
from .plan import ShardPlan
from .rounds import parameter_mean


class Sharded(DataParallel):
    """``sharding="optimizer"``, ``"gradients"`` or ``"parameters"`` over the ranks running
    (one or more)."""

    def __init__(self, exact: bool = False, local: bool = False) -> None:
        super().__init__(exact, local)
        self.ranks = self.probes = distributed.active() is not None  # one process: one rank's plan, no probe
        self.holds_gradients = not self.ranks
        self.local = local and self.ranks
        self.name = "sharded" + (" (exact reduction)" if exact else "")
        self.plan: Optional[ShardPlan] = None  # cut when the loop starts
        self.rank = distributed.rank_world()[0]
        self.shards: Optional[ParameterShards] = None  # sharding="parameters": this rank's values, the hooks
        self.guard_next = False  # until the first update is applied: no released Parameter read (guard)

    def draw_states(self, runner: Runner) -> Optional[list]:
        # one process runs the items in order: they draw as the plain loop's, nothing to line up
        return super().draw_states(runner) if self.ranks else None

    # ------------------------------------------------------------ one update
    def mean(self, runner: Runner, leaves, scratch, batch, o, want_loss: bool, states: Optional[list]) -> Mean:
        if self.shards is not None:  # item by item, whatever the reduction: the one-process fold (rounds.py)
            mine, own = self.shares(batch, states)
            return parameter_mean(runner, leaves, scratch, batch, mine, own, len(batch), self.plan, self.rank,
                                  self.shards, o.scaler is None)
        if self.exact:
            if not self.ranks:
                return Reduction.mean(self, runner, leaves, scratch, batch, o, want_loss, states)
            return super().mean(runner, leaves, scratch, batch, o, want_loss, states)
        # this rank's items summed, then reduce-scattered by the plan; the loss summed in rank order
        n = self.count(runner, len(batch))
        mine, own = self.shares(batch, states)
        plan, rank, world = self.plan, self.rank, self.plan.world
        whole = not shard_step.keeps_ranges(plan, o.clip_grad_norm)
        if world > 1 and o.accumulation == "exact":  # the reduce-scatter under the last backward
            loss, grads = overlapped_ranges(runner, leaves, scratch, mine, own, plan, rank)
            grads = shard_step.whole_of(plan, rank, runner.params, grads) if whole else grads
        else:
            loss, grads = None, [None] * len(leaves)
            if mine and o.accumulation == "vectorized":
                loss, grads = stacked_loss_and_gradients(runner, mine, leaves, scale=1.0)
            elif mine:
                loss, grads = sum_items(runner, mine, leaves, scratch, own)
            grads = shard_step.reduced(runner, leaves, plan, rank, grads, whole=whole)
        return Mean.of_sums(shard_step.reduced_loss(runner, loss, want_loss, world), grads, n, o.scaler is None)

    def agree(self, found: torch.Tensor, o) -> None:
        if shard_step.keeps_ranges(self.plan, o.clip_grad_norm):
            comm.flag_any(found, self.plan.world)  # each rank checked its ranges: one verdict for all

    def apply(self, runner: Runner, opt, state, grads, found, snapshot, o):
        """Clipping on whole gradients (``"optimizer"`` clipping by norm) or on the owned
        ranges, the owned ranges updated, then gathered (``step.py``)."""
        skipping(found, snapshot, o)
        plan, rank = self.plan, self.rank
        sums, norm, presummed = None, None, False
        if not shard_step.keeps_ranges(plan, o.clip_grad_norm):  # whole gradients: clip_grad_norm_'s bits
            grads, norm = clipped(runner, grads, o)
            presummed = True
        elif o.clipping:
            sums = shard_step.canonical_ranges(plan, rank, grads)
            norm = shard_step.clip_ranges(plan, rank, sums, o.clip_grad_norm, o.clip_grad_value,
                                          [v.storage.working() for v in runner.params])
        state = shard_step.apply(runner, opt, state, plan, rank, grads, found if o.skips else None, presummed, sums,
                                 None if self.shards is None else self.shards.values)
        if o.scaler is not None:
            o.scaler.update(found)
        return state, norm

    def after(self, runner: Runner, advanced: bool) -> None:
        self.guard_next = False
        super().after(runner, advanced)
