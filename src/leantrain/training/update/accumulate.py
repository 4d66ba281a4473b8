"""Summing item gradients, left to right (spec §7.1): the one fold every path uses.

``fold`` sums a sequence of (loss, gradients) pairs in item order (``l0 + l1``, then
``+ lk``; ``g0 + g1``, then ``add_(gk)``); a slot only some items used gets the sum over
those, one no item used stays ``None``. ``item_gradients`` differentiates the items one
by one, lazily, so ``fold(item_gradients(...))`` holds one item's gradients besides the
sums. Data parallel's exact reduction folds the gathered items with the same ``fold``.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional, Sequence

import torch

from ..runner.binding import set_rng_state
from ...errors import ConfigError, DataError
from .mean import Pack
from ..runner.runner import Runner, Sample
from ...samples import add_losses
from .vectorized import stacked_loss_and_gradients


def add_into(grads: Pack, more: Pack) -> None:
    """``grads[i] += more[i]`` in place (owned sums), taking ``more[i]`` where ``grads[i]``
    has none yet."""
    for i, h in enumerate(more):
        if h is not None:
            if grads[i] is None:
                grads[i] = h
            else:
                grads[i].add_(h)


def fold(items: Iterable[tuple[torch.Tensor, Pack]]) -> tuple[torch.Tensor, Pack]:
    """Loss and gradient sums over nonempty ``items``, left to right, written into the
    first item's gradients (``g.add_(h)``: the bits of ``g + h``; every item's gradients
    are its own memory, ``backward.own_gradients``)."""
    it = iter(items)
    loss, grads = next(it)
    second = next(it, None)
    if second is None:
        return loss, grads
    loss = add_losses(loss, second[0])
    add_into(grads, second[1])  # the first item's gradients are this fold's own: they become the sums
    del second  # from here one item's gradients besides the sums, as .grad accumulation holds
    for loss_k, grads_k in it:
        loss = add_losses(loss, loss_k)
        add_into(grads, grads_k)
        del grads_k  # gone before the next item is differentiated
    return loss, grads


def item_gradients(runner: Runner, batch: Sequence[Sample], leaves, scratch,
                   states: Optional[list] = None) -> Iterator[tuple[torch.Tensor, Pack]]:
    """Each item's (loss, gradients), one at a time, in order. ``scratch.reset()`` before
    every item after the first: every item sees the same advanced buffers. ``states``:
    the generators' state each item starts from (data parallel, see ``draws``)."""
    for j, sample in enumerate(batch):
        if j:
            scratch.reset()
        draws(runner, states, j)
        try:
            pair = runner.loss_and_gradients(sample, leaves)
        except (DataError, ConfigError) as e:
            raise type(e)(f"item {j}: {e}") from e  # which item of the batch
        yield pair
        del pair  # not held while the next item is differentiated


def sum_items(runner: Runner, batch: Sequence[Sample], leaves, scratch,
              states: Optional[list] = None) -> tuple[torch.Tensor, Pack]:
    """``fold`` over the items' gradients, differentiated one by one."""
    return fold(item_gradients(runner, batch, leaves, scratch, states))


def draws(runner: Runner, states: Optional[list], j: int) -> None:
    """Put the generators where item ``j`` starts in one process (data parallel with a
    model that draws random numbers: every item draws its own numbers, wherever it runs)."""
    if states is not None:
        set_rng_state(runner.device, states[j])


def sum_hooked(runner: Runner, mine: Sequence[Sample], leaves, scratch, own: Optional[list], make_reducer,
               vectorized: bool = False):
    """The loss sum of ``mine`` with the last backward under a reducer's gradient hooks
    (data parallel's overlap, ``parallel/overlap.py`` and ``parallel/sharding/overlap.py``):
    all items but the last are folded first (``sum_items``), then ``make_reducer(partial)``
    hooks every leaf while the last item (or, ``vectorized``, the stacked items) is
    differentiated. Returns ``(reducer, loss, grads)``; the hooks
    are removed also on error."""
    partial_loss, partial = None, None
    if not vectorized and len(mine) > 1:
        partial_loss, partial = sum_items(runner, mine[:-1], leaves, scratch, own)
        scratch.reset()
    if not vectorized:
        draws(runner, own, len(mine) - 1)
    reducer = make_reducer(partial)
    handles = [t.register_hook(reducer.hook(i)) for i, t in enumerate(leaves) if t is not None]
    try:
        if vectorized:
            loss, grads = stacked_loss_and_gradients(runner, mine, leaves, scale=1.0)
        else:
            loss, grads = runner.loss_and_gradients(mine[-1], leaves)
    finally:
        for h in handles:
            h.remove()
    if partial_loss is not None:
        loss = add_losses(partial_loss, loss)
    return reducer, loss, grads
