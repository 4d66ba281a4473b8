"""Parameter sharding's mean: the update's items in rounds of one item per rank, each
item's gradient reduce-scattered to the owners while its backward runs.

Item ``j`` of an update's ``n`` runs on rank ``j mod world`` in round ``j // world``. In a
round every rank differentiates its item with the parameters gathered unit by unit
(``gathering.py``); a hook on each leaf hands the gradient to the round's reducer
(``overlap.ShardReducer``: buckets sent point to point as they complete) and
lets the storage go, and the owner of each range adds what it receives to its running sum
in item order: ``g0 + g1``, then ``+ g2``, the one-process fold's additions, so the
mean has the one-process bits on any number of ranks, exact reduction or not. A rank holds
its ranges of the sums, never a whole gradient pack.

A rank without an item in a round (``n`` not a multiple of the world size) runs a
stand-in: the forward and backward of one of the batch's items, with the generators put
back afterwards, the buffers' scratch copies reset and zeros sent for its gradient (its
owners skip it), so every rank issues the same gathers and sends in the same order and no
rank waits for one that will never come. The item losses travel as float64 rows at the
end and are summed in item order (``exact_fold.item_losses``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...runner.backward import taken
from ...runner.binding import rng_preserved
from ...update.mean import draws, drawn
from ...update.mean import Mean
from ...runner.runner import Runner
from ....samples import add_losses
from ..data_parallel import folded_loss
from ..exact_fold import item_losses, loss_row
from ..overlap import step_buckets
from .gathering import ParameterShards
from .overlap import ShardReducer
from .plan import ShardPlan


class _Local:
    """One rank alone: each slot's gradients summed in item order, in flat memory of their own."""

    def __init__(self, n: int) -> None:
        self.sums: list = [None] * n

    def fill(self, i: int, g: Optional[torch.Tensor]) -> None:
        if g is None:
            return
        s = self.sums[i]
        if s is None:
            s = self.sums[i] = torch.empty(g.numel(), dtype=g.dtype, device=g.device)
            s.view(g.shape).copy_(g)  # the first item's own values, in the slot's memory order
        else:
            s.view(g.shape).add_(g)


def _hooked(runner: Runner, leaves, sample, reducer, shards: ParameterShards, real: bool):
    """One item's loss, its gradients handed to ``reducer`` leaf by leaf as they come."""

    def hook(i: int):
        def on_gradient(g: torch.Tensor) -> torch.Tensor:
            reducer.fill(i, g if real else None)
            shards.handed_over(i)
            return taken(g)  # the reducer has it: autograd's result need not keep it
        return on_gradient

    handles = [t.register_hook(hook(i)) for i, t in enumerate(leaves) if t is not None]
    shards.tracking = True
    try:
        return runner.loss_and_gradients(sample, leaves)
    finally:
        for h in handles:
            h.remove()
        shards.tracking = False
        shards.settle()


def parameter_mean(runner: Runner, leaves, scratch, batch: list, mine: list, own: Optional[list], n: int,
                   plan: ShardPlan, rank: int, shards: ParameterShards, unscaled: bool) -> Mean:
    """The update's mean loss and this rank's ranges of the mean gradient (see the
    module's doc). ``mine``: this rank's items (item ``rank``, ``rank + world``...);
    ``own``: the generator states they start from (a model that draws)."""
    world = plan.world
    rows = -(-n // world)
    buckets = step_buckets(runner, leaves)[0] if world > 1 else None
    into: dict = {}
    local = _Local(len(leaves)) if world == 1 else None
    loss_rows = torch.zeros(max(rows, 1), 2, dtype=torch.float64, device=runner.device)
    first, loss_sum, out = None, None, [None] * len(leaves)
    for r in range(rows):
        if r:
            scratch.reset()  # every item sees the buffers the buffer pass advanced
        real = r < len(mine)
        reducer = local if local is not None else ShardReducer(
            plan, rank, buckets, None, into, [q for q in range(world) if r * world + q < n])
        if real:
            draws(runner, own, r)
            loss, grads = _hooked(runner, leaves, mine[r], reducer, shards, True)
            drawn(runner, own, r)
            first = loss if first is None else first
            loss_sum = loss if loss_sum is None else add_losses(loss_sum, loss)
            loss_row(loss_rows, r, loss)
        else:
            stand_in = mine[-1] if mine else batch[0]
            with rng_preserved(runner.device):  # the stand-in draws nothing anyone keeps
                _hooked(runner, leaves, stand_in, reducer, shards, False)
            grads = None
        if local is None:
            out = reducer.finish(grads)  # what no hook handed over (an unused slot: zeros), then wait
        del grads
    if local is not None:
        out = local.sums
        loss = loss_sum
    else:
        loss = folded_loss(item_losses(loss_rows, n, world, first), first)
    return Mean.of_sums(loss, out, n, unscaled)
