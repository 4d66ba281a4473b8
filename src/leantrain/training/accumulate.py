"""Summing item gradients, left to right (spec §7.1): the one fold every path uses.

``sum_items`` differentiates the items one by one and sums their losses and gradients
in item order (``g0 + g1``, then ``add_(gk)``); a slot only some items used gets the
sum over those, one no item used stays ``None``. ``scale`` applies the ``1/n``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .binding import set_rng_state
from .runner import Runner, Sample

Pack = list[Optional[torch.Tensor]]


def plus(g: Optional[torch.Tensor], h: Optional[torch.Tensor], out: Optional[torch.Tensor] = None):
    """``g + h`` where both items used the slot; the one gradient where only one did
    (the sum over the items that used it, as ``.grad`` accumulation gives)."""
    if g is None or h is None:
        return h if g is None else g
    return g + h if out is None else torch.add(g, h, out=out)


def add_into(grads: Pack, more: Pack) -> None:
    """``grads[i] += more[i]`` in place (owned sums), taking ``more[i]`` where ``grads[i]``
    has none yet."""
    for i, h in enumerate(more):
        if h is not None:
            if grads[i] is None:
                grads[i] = h
            else:
                grads[i].add_(h)


def sum_items(runner: Runner, batch: Sequence[Sample], leaves, scratch, out: Optional[list] = None,
               states: Optional[list] = None) -> tuple[torch.Tensor, Pack]:
    """Loss and gradient sums over the items, left to right (autograd's own tensors for one).

    ``scratch.reset()`` before each item: every item sees the same advanced buffers.
    A slot only some items used sums those items' gradients; one no item used stays
    ``None``. ``out``: per slot, a tensor the sum is written into (the same ``g + h``)
    instead of fresh memory, for a caller that reuses it step after step. ``states``:
    the generators' state each item starts from (data parallel, see ``draws``)."""
    draws(runner, states, 0)
    loss, grads = runner.loss_and_gradients(batch[0], leaves)
    if len(batch) == 1:
        return loss, grads
    scratch.reset()
    draws(runner, states, 1)
    loss2, grads2 = runner.loss_and_gradients(batch[1], leaves)
    loss = loss + loss2
    outs = out if out is not None else [None] * len(grads)
    grads = [plus(g, h, o) for g, h, o in zip(grads, grads2, outs)]  # owned from here
    for j, sample in enumerate(batch[2:], start=2):
        scratch.reset()
        draws(runner, states, j)
        loss_k, grads_k = runner.loss_and_gradients(sample, leaves)
        loss = loss + loss_k
        add_into(grads, grads_k)
    return loss, grads


def draws(runner: Runner, states: Optional[list], j: int) -> None:
    """Put the generators where item ``j`` starts in one process (data parallel with a
    model that draws random numbers: every item draws its own numbers, wherever it runs)."""
    if states is not None:
        set_rng_state(runner.device, states[j])


def scale(loss: torch.Tensor, grads: Pack, inv: float, defer: bool = False):
    """``(loss * inv, grads * inv, None)``, the gradients scaled in place (owned sums
    here). ``defer``: float32 gradients are left unscaled and ``inv`` is returned instead
    of ``None``: ``nonfinite_flag`` multiplies them in its own pass over them (the same
    float32 product, so the same bits), which saves a pass over every gradient."""
    if defer and all(g is None or (g.dtype == torch.float32 and g.layout == torch.strided) for g in grads):
        return loss * inv, grads, inv
    for g in grads:
        if g is not None:
            g.mul_(inv)
    return loss * inv, grads, None
