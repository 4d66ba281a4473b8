"""Sharding's reduction (ZeRO stages 1, 2 and 3): the ``Sharded`` strategy a loop chooses.

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

import contextlib
from typing import Optional

import torch

from ....errors import ConfigError
from ...runner.runner import Runner
from ...update.reduction import clipped, skipping
from ...update.mean import Mean
from ...update.reduction import Reduction
from ...update.accumulate import sum_items
from ...update.vectorized import stacked_loss_and_gradients
from .. import distributed
from ..data_parallel import DataParallel
from . import comm, step as shard_step
from .checkpoint import save_sharded
from .ema import ShardedEMA
from .gathering import ParameterShards
from .overlap import overlapped_ranges
from .plan import ShardPlan
from .rounds import parameter_mean
from .state import check_plan, loop_start


def check_trainable_kept(op: str, runner: Runner) -> None:
    """A sharded run trains the slots trainable at its start: a ``requires_grad`` turned on
    or off since (a callback unfreezing a backbone) is refused before the next update or
    save, so no checkpoint marks a slot trainable without its optimizer state."""
    changed = runner.view.changed_requires_grad()
    if changed:
        i = changed[0]
        now = "on" if runner.view.originals[i].requires_grad else "off"
        raise ConfigError(
            f"{op}: {runner.params.label(i)}: requires_grad was turned {now} during a sharded run; sharding cut "
            f"the optimizer state of the slots trainable when the run started, so it cannot follow (nothing was "
            f"saved with the change: the last checkpoint stays valid). Start a new sharded run with the slot "
            f"{'trainable' if now == 'on' else 'frozen'} from the start (from these weights), or train unsharded")


class Sharded(DataParallel):
    """``sharding="optimizer"``, ``"gradients"`` or ``"parameters"`` over the ranks running
    (one or more)."""

    host_state = True  # a resume reads the state into host memory and moves this rank's ranges only

    def __init__(self, exact: bool = False, local: bool = False) -> None:
        super().__init__(exact, local)
        self.ranks = distributed.active() is not None
        self.local = local and self.ranks
        self.name = "sharded" + (" (exact reduction)" if exact else "")
        self.plan: Optional[ShardPlan] = None  # cut when the loop starts
        self.rank = distributed.rank_world()[0]
        self.shards: Optional[ParameterShards] = None  # sharding="parameters": this rank's values, the hooks
        self.guard_next = False  # until the first update is applied: no released Parameter read (guard)

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
            grads = shard_step.reduced(plan, rank, runner.params, grads, whole=whole)
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

    # ------------------------------------------------------------ a loop's run
    def start(self, op: str, cfg, runner: Runner, opt, native: bool, whole=None):
        plan, state = loop_start(op, cfg, runner, opt, native, whole)
        if plan.mode == "parameters":
            if self.local:
                raise ConfigError(f"{op}: sharding='parameters' needs every rank to read the same batches (each "
                                  f"rank's own items would give the ranks different numbers of forwards, and "
                                  f"the gathers are collectives); give the loop the whole data, or shard "
                                  f"'gradients'")
            self.shards = ParameterShards(op, runner, plan, self.rank)  # the parameters' memory released from here
            self.guard_next = True
        self.plan = plan
        return state

    def guard(self, op: str):
        """Until the run's first update is applied, a read of a released Parameter is
        refused (``gathering.py``): the model's calls are the same from then on."""
        if self.guard_next and self.shards is not None:
            return self.shards.guarded(op)
        return contextlib.nullcontext()

    def after(self, runner: Runner, advanced: bool) -> None:
        self.guard_next = False
        super().after(runner, advanced)

    def user_code(self):
        """The user's code between updates sees every Parameter whole."""
        return contextlib.nullcontext() if self.shards is None else self.shards.whole()

    def close(self, runner: Runner, failed: bool) -> None:
        if self.shards is not None:
            self.shards.close(failed)
            self.shards = None

    def ema(self, runner: Runner, decay: float, saved=None):
        if saved is None:
            return ShardedEMA(runner.params, decay, self.plan, self.rank)
        return ShardedEMA.cut(runner.params, saved, self.plan, self.rank)  # cut from host memory

    def check_shared(self, op: str, checkpoint_path) -> None:
        # every rank writes its shard into the folder: one per node would save, and never load
        distributed.check_shared_folder(op, checkpoint_path)

    def check_step(self, op: str, runner: Runner, batch: list) -> None:
        check_trainable_kept(op, runner)  # before the binding would follow a changed requires_grad
        check_plan(op, self.plan, runner.slot_map())
        super().check_step(op, runner, batch)

    def save(self, path, runner: Runner, state, progress: dict, loader_state, ema) -> None:
        check_trainable_kept("save_checkpoint", runner)  # never a checkpoint marking a slot with no state
        # every rank writes its file, rank 0 the index (checkpoint.py)
        if callable(loader_state):
            loader_state = loader_state()
        save_sharded(path, runner, self.plan, self.rank, state, progress=progress, loader_state=loader_state, ema=ema,
                     values=None if self.shards is None else self.shards.values)

    def finish(self, runner: Runner) -> None:
        self.close(runner, failed=False)  # the module whole again (parameter sharding)
        if isinstance(runner.ema, ShardedEMA):
            runner.keep_ema(runner.ema.whole(runner.params))  # every rank: the whole average

    def failed(self, op: str, e: RuntimeError, where: str, last: str):
        if not self.ranks:
            raise e
        super().failed(op, e, where, last)
