"""The gradients of a list batch under data parallel (``torch.distributed``).

Each rank differentiates its share of the items (item ``j`` on rank ``j mod world``).
The default all-reduces the ranks' sums bucket by bucket while the last backward runs
(``overlap.py``); ``exact_reduction`` gathers every item's gradient and folds them in
item order, as one process does. With a model that draws random numbers, every item
starts from the generator state it has in one process (``item_states``), so an item
draws the same dropout mask whichever rank computes it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import distributed, overlap
from ..update.accumulate import fold, item_gradients, sum_hooked
from ..update.mean import Mean
from ...samples import LossSum
from ...errors import DataError
from ..runner.runner import Runner

def exact_gradients(runner: Runner, leaves, scratch, mine: list, n: int, rank: int, world: int,
                    own: Optional[list] = None) -> Mean:
    """Each rank differentiates its items (``mine``; item ``j`` of the ``n`` is on rank
    ``j mod world``) one by one; every rank then folds all items in item order
    (``exact_reduction``) with ``accumulate.fold``, then ``* (1/n)``: the one-process mean
    gradient, bit for bit, on any number of ranks. ``own``: the generator states each of
    ``mine`` starts from (a model that draws)."""
    pairs = list(item_gradients(runner, mine, leaves, scratch, own))
    losses, packs = distributed.gather_items(pairs, n, rank, world, leaves)
    first = pairs[0][0] if pairs else None  # rank 0 always has item 0: it logs
    dtype = torch.float64 if first is None else (first.total if isinstance(first, LossSum) else first).dtype
    losses = [LossSum(x.total.to(dtype), x.count) if isinstance(x, LossSum) else x.to(dtype) for x in losses]
    loss, grads = fold(zip(losses, packs))
    return Mean.of_sums(loss, grads, n)


def overlapped_sums(runner: Runner, leaves, scratch, mine: list, accumulation: str, want_loss: bool,
                     own: Optional[list] = None):
    """This rank's gradient sum over ``mine``, all-reduced over the ranks bucket by bucket
    while the last backward runs (see ``overlap.py``): the same fold as ``sum_items``, so
    the same bits as summing first and all-reducing after. ``(None, grads)`` unless
    ``want_loss`` or the loss is a ``LossSum`` (whose summed count divides the gradients:
    it is reduced every step, with its total)."""
    plan, reuse = overlap.step_buckets(runner, leaves)
    if not mine:  # more ranks than items: this rank sends zeros in the same buckets
        reducer = overlap.Reducer(plan, None, reuse)
        reducer.send(None)
        return _reduced(runner, reducer, None, None, want_loss)
    out = plan.partial_buffers() if reuse and len(mine) > 2 and accumulation == "exact" else None
    reducer, loss, grads = sum_hooked(runner, mine, leaves, scratch, own,
                                      lambda partial: overlap.Reducer(plan, partial, reuse), out,
                                      vectorized=accumulation == "vectorized")
    reducer.send(grads)
    return _reduced(runner, reducer, grads, loss, want_loss)


def _reduced(runner: Runner, reducer, grads, loss, want_loss: bool):
    """Wait for the gradients and reduce the loss: a ``LossSum``'s total and count as one
    float64 pair (a rank without items sends zeros), a scalar loss only if asked for."""
    if sums_losses(runner, loss):
        pair = torch.zeros(2, dtype=torch.float64, device=runner.device) if loss is None else torch.stack(
            [loss.total.detach().to(torch.float64), torch.as_tensor(loss.count, device=loss.total.device)
             .to(torch.float64)])
        dtype = torch.float32 if loss is None else loss.total.dtype
        pair, reduced = reducer.finish(grads, pair)
        return LossSum(pair[0].to(dtype), pair[1]), reduced  # the count stays on the device: never read back
    if want_loss and loss is None:
        loss = torch.zeros((), device=runner.device)
    total, reduced = reducer.finish(grads, loss if want_loss else None)
    return (None if total is None else total[0]), reduced


def sums_losses(runner: Runner, loss) -> bool:
    """Whether the runner's loss is a ``LossSum``, agreed by every rank once (a rank
    without items has no loss to look at): one all-reduce of a flag, read back once per
    runner. After that, a loss of the other kind is refused on the rank that meets it."""
    if runner.sums_losses is None:
        flag = torch.tensor([-1.0 if loss is None else float(isinstance(loss, LossSum))], device=runner.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=distributed.group())
        runner.sums_losses = bool(flag.item() > 0)  # intentional sync: once per runner, to agree on the loss kind
    if loss is not None and isinstance(loss, LossSum) != runner.sums_losses:
        raise DataError(f"data parallel step: the loss returned {type(loss).__name__} where earlier steps (or other "
                        f"ranks) returned {'LossSum' if runner.sums_losses else 'a scalar'}: one loss, one kind")
    return runner.sums_losses


def item_states(runner: Runner, bound, op: str, batch, recorded: Optional[list]) -> Optional[list]:
    """The per-item generator states of a data-parallel step: those the buffer pass
    recorded, or a pass of their own; ``None`` when the model draws nothing."""
    if recorded is None:
        return bound.draw_states(op, batch)
    return recorded if runner.learned_draws(recorded) else None
