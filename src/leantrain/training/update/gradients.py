"""An update's gradients: buffers first, then every item at one parameter point (spec §7.1).

A list batch is gradient accumulation. In train mode the buffers advance for every
item first (one no-gradient forward per item, once the model is known to write
buffers); then every item is differentiated at the same parameter point and against
the same, fully advanced buffers; the gradients are folded left to right and
multiplied by ``1/n`` (``mean.Mean``). Under ``torch.distributed`` each rank
differentiates its share of the items (``dp_gradients.py``). Losses stay on the
device unless ``mean_loss_and_gradients`` is called, which reads one scalar back.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..parallel import distributed
from ..parallel import data_parallel as dp
from ..parallel import rank_data
from ..parallel.sharding import step as shard_step
from ..parallel.sharding.overlap import overlapped_ranges
from .accumulate import sum_items
from ..runner.binding import BufferSnapshot, rng_state, set_rng_state
from .mean import Mean, Pack
from ..runner.runner import Runner, Sample, check_sample
from ...samples import check_alike
from .options import StepOptions
from .vectorized import check_stackable, stacked_loss_and_gradients
from ...errors import DataError


def check_batch(op: str, batch: Sequence[Sample], local: bool = False) -> list[Sample]:
    """A batch is a nonempty list of samples of one structure (``samples.py``).
    ``local``: this rank's items of a rank-local update, which the ranks' count checks
    together (``rank_data.global_count``), so that every rank raises alike."""
    if not isinstance(batch, (list, tuple)):
        raise DataError(f"{op}: a batch is a list of (x, y) samples, got {type(batch).__name__}")
    if len(batch) == 0 and not local:
        raise DataError(f"{op}: empty batch")
    checked = [check_sample(op, s, i) for i, s in enumerate(batch)]
    if len(checked) > 1:
        check_alike(op, checked)
    return checked


def batch_mean(op: str, runner: Runner, batch: list[Sample], o: StepOptions, want_loss: bool = False
               ) -> tuple[Mean, Optional[BufferSnapshot]]:
    """The mean loss and gradients of a checked batch, the buffers advanced first;
    nothing read to the host. Also returns the buffers as they were before the step when
    it advanced any, so the caller can undo a rejected step (a model error undoes them
    here)."""
    if o.accumulation == "vectorized":
        check_stackable(runner, batch)  # before the buffers move
    with runner.binding(op) as bound:
        if len(batch) == 1 and o.accumulation == "exact" and runner.has_buffer_updates and distributed.active() is None:
            loss, grads, snapshot = bound.one_item(op, batch[0])  # one forward, as plain PyTorch
            return Mean.of_sums(loss, grads, 1, o.scaler is None), snapshot
        rng = rng_state(runner.device) if runner.has_buffer_updates else None
        # Data parallel: where each item's random draws start in one process (dropout).
        states = [] if distributed.active() is not None and runner.mode == "train" and runner.draws is not False \
            and not runner.loop.local else None  # rank-local data: each rank draws its own
        while True:
            ran, snapshot = bound.advance_buffers(op, batch, states=states)  # every item, before any gradient
            runner.stats.buffer_passes += ran
            if states is not None:
                states = dp.item_states(runner, bound, op, batch, states if ran else None)
            try:
                with bound.scratch_buffers() as scratch:  # gradient passes leave buffers be
                    mean = _items_mean(runner, bound.leaves, scratch, batch, o, want_loss, states)
            except BaseException:
                if snapshot is not None:
                    snapshot.restore()
                raise
            if states is not None:
                set_rng_state(runner.device, states[-1])  # every rank where one process ends
            if ran or not scratch.written:
                if rng is not None and not ran:
                    runner.learned_buffer_writes(False)  # seen: a forward writes no buffer
                return mean, snapshot
            # The model wrote a buffer although none was seen written before: redo the
            # step with the buffer pass (the real buffers were not touched; the
            # generators replay, so the redone step draws the same numbers).
            if distributed.active() is not None:  # one rank cannot redo a step the others have done
                raise DataError(f"{op}: the model wrote a buffer in this step although its first data-parallel "
                                f"step wrote none (a buffer written only for some inputs); under "
                                f"torch.distributed the ranks cannot redo one step apart")
            runner.learned_buffer_writes(True)
            runner.stats.redone_steps += 1
            set_rng_state(runner.device, rng)


def _items_mean(runner: Runner, leaves, scratch, batch: Sequence[Sample], o: StepOptions, want_loss: bool,
                states: Optional[list]) -> Mean:
    """The mean at one parameter point, in one process or across the ranks. The loss
    joins the all-reduce only if ``want_loss``."""
    n, group = len(batch), distributed.active()
    local = group is not None and runner.loop.local  # each rank's batch is its own items (rank_data.py)
    if local:
        n = rank_data.global_count(runner, n)
    defer = o.scaler is None  # the 1/n rides the non-finite check's pass (not with a loss scale)
    if o.shards is not None and not o.exact_reduction:
        return sharded_mean(runner, leaves, scratch, batch, o, want_loss, states, n, local)
    if group is None:
        if o.accumulation == "vectorized":
            return Mean(*stacked_loss_and_gradients(runner, batch, leaves, scale=1.0 / n))
        return Mean.of_sums(*sum_items(runner, batch, leaves, scratch), n, defer)
    mine = batch if local else distributed.my_items(batch, *group)
    own = None if states is None else distributed.my_items(states[:-1], *group)
    if o.exact_reduction:
        return dp.exact_gradients(runner, leaves, scratch, mine, n, *group, own)
    loss, grads = dp.overlapped_sums(runner, leaves, scratch, mine, o.accumulation, want_loss, own)
    if loss is None:
        loss = torch.zeros((), device=runner.device)  # not asked for: never read
    return Mean.of_sums(loss, grads, n, defer)


def sharded_mean(runner: Runner, leaves, scratch, batch: Sequence[Sample], o: StepOptions, want_loss: bool,
                 states: Optional[list], n: int, local: bool = False) -> Mean:
    """Sharding's default reduction: this rank's items summed, then reduce-scattered by
    the plan (``shard_step.reduced``); the loss summed over the ranks in rank order.
    ``n``: the update's items over all ranks; ``local``: ``batch`` is this rank's own."""
    rank, world = distributed.rank_world()
    mine = batch if local else distributed.my_items(batch, rank, world)
    own = None if states is None else distributed.my_items(states[:-1], rank, world)
    whole = not shard_step.keeps_ranges(o.shards, o.clip_grad_norm)
    if world > 1 and o.accumulation == "exact":  # the reduce-scatter under the last backward
        loss, grads = overlapped_ranges(runner, leaves, scratch, mine, own, o.shards, rank)
        grads = shard_step.whole_of(o.shards, rank, runner.params, grads) if whole else grads
    else:
        loss, grads = None, [None] * len(leaves)
        if mine and o.accumulation == "vectorized":
            loss, grads = stacked_loss_and_gradients(runner, mine, leaves, scale=1.0)
        elif mine:
            loss, grads = sum_items(runner, mine, leaves, scratch, None, own)
        grads = shard_step.reduced(o.shards, rank, runner.params, grads, whole=whole)
    return Mean.of_sums(shard_step.reduced_loss(runner, loss, want_loss, world), grads, n, o.scaler is None)


def mean_gradients(runner: Runner, batch: Sequence[Sample], *, accumulation: str = "exact") -> Pack:
    """Mean per-slot gradients of a nonempty batch at one parameter point: ``None`` at
    frozen slots and at slots no item used (torch's ``.grad is None``); a slot some items
    used has the sum over those items times ``1/n``. Each gradient is dense in its
    parameter's layout and in memory of its own."""
    op = "mean_gradients"
    o = StepOptions.checked(op, accumulation=accumulation)
    return batch_mean(op, runner, check_batch(op, batch), o)[0].gradients()


def mean_loss_and_gradients(
    runner: Runner, batch: Sequence[Sample], *, accumulation: str = "exact"
) -> tuple[float, Pack]:
    """Mean loss and mean gradients; reads the loss back to the host (a sync on CUDA)."""
    op = "mean_loss_and_gradients"
    o = StepOptions.checked(op, accumulation=accumulation)
    mean, _ = batch_mean(op, runner, check_batch(op, batch), o, want_loss=True)
    return float(mean.loss.item()), mean.gradients()  # intentional sync: the caller asked for the loss
