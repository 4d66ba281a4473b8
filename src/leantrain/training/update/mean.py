"""An update's mean loss and gradients (spec §7.1): the items' fold and ``Mean``.

The fold: ``fold`` sums a sequence of (loss, gradients) pairs in item order (``l0 + l1``,
then ``+ lk``; ``g0 + g1``, then ``add_(gk)``); a slot only some items used gets the sum
over those, one no item used stays ``None``. ``item_gradients`` differentiates the items
one by one, lazily, so ``fold(item_gradients(...))`` holds one item's gradients besides
the sums. Data parallel's exact reduction folds the gathered items with the same ``fold``.

The mean, as one typed value:

``sum * (1/n)`` is the contract. For float32 dense gradients the multiply is deferred
into the non-finite check's own pass over them (``flag_nonfinite``): the same float32 product,
so the same bits, one pass fewer over every gradient. ``Mean`` owns that pending
factor, so no phase between accumulation and the check needs to know about it: the
gradients are read through ``gradients()`` (which applies a factor still pending) or
``flag_nonfinite()`` (which flags non-finite values and applies it in the kernel's pass, or first when the kernel unscales by
a loss scale); ``held()`` gives them as held, for checks of layout and device only.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional, Sequence

import torch

from ...errors import ConfigError, DataError
from ...samples import LossSum, add_losses
from ..runner.backward import taken
from ..runner.binding import rng_state, same_rng, set_rng_state
from ..runner.runner import Runner, Sample
from .vectorized import stacked_loss_and_gradients

Pack = list[Optional[torch.Tensor]]

_FLAGS: dict = {}  # per device: (a reusable flag, a unit scale)
_FACTORS: dict = {}  # per (device, 1/n): the float32 factor as a one-element tensor


class Mean:
    """The mean loss (a device scalar) and per-slot mean gradients of one update."""

    __slots__ = ("loss", "_grads", "_pending")

    def __init__(self, loss: torch.Tensor, grads: Pack, pending: Optional[float] = None) -> None:
        self.loss = loss
        self._grads = grads
        self._pending = pending  # 1/n not yet multiplied into the float32 gradients

    @classmethod
    def of_sums(cls, loss, grads: Pack, n: int, defer: bool = False) -> "Mean":
        """The mean of ``n`` items from their sums (owned tensors: scaled in place). One
        item is its own mean (``g * (1/1)`` is ``g``: no pass). ``defer``: leave the
        multiply of float32 dense gradients to ``flag_nonfinite``. A ``LossSum`` (the items'
        totals and counts added) divides by its count instead: the gradient of (sum of
        totals) / (sum of counts). A tensor count is never read back: its reciprocal is
        taken on its device (in binary64, then rounded to float32, as ``1.0/n``)."""
        if isinstance(loss, LossSum):
            count = loss.count
            if isinstance(count, torch.Tensor):  # a tensor count is never read back (on any device)
                c = count.to(loss.total.device, torch.float64)
                # a summed count below 1 (a negative count) poisons the update: refused or skipped as non-finite
                factor = torch.where(c >= 1, c.reciprocal(), torch.nan).float().reshape(1)
                value = loss.total * factor[0]
                if defer and all(g is None or (g.dtype == torch.float32 and g.layout == torch.strided) for g in grads):
                    return cls(value, grads, factor)
                for g in grads:
                    if g is not None:
                        g.mul_(factor)
                return cls(value, grads)
            loss, n = loss.total, count
        if n == 1:
            return cls(loss, grads)
        inv = 1.0 / n
        if defer and all(g is None or (g.dtype == torch.float32 and g.layout == torch.strided) for g in grads):
            return cls(loss * inv, grads, inv)
        for g in grads:
            if g is not None:
                g.mul_(inv)
        return cls(loss * inv, grads)

    def held(self) -> Pack:
        """The gradients as held (perhaps still without ``1/n``): for layout and device
        checks only."""
        return self._grads

    def gradients(self) -> Pack:
        """The mean gradients (``None``: no item used the slot, or it is frozen)."""
        if self._pending is not None:
            for g in self._grads:
                if g is not None:
                    g.mul_(self._pending)
            self._pending = None
        return self._grads

    def flag_nonfinite(self, buffers: Sequence[torch.Tensor] = (), inv_scale: Optional[torch.Tensor] = None
              ) -> torch.Tensor:
        """A one-element device flag: 1.0 when the loss, any gradient or any of ``buffers``
        (those the step's buffer pass wrote) is NaN or infinite. Nothing is read to the host.

        One fused kernel (the one ``GradScaler`` uses) with a unit scale, which leaves the
        values bit for bit; with ``inv_scale`` (float16 loss scaling) the gradients are
        unscaled by it in the same pass, and a pending ``1/n`` is multiplied in there.
        """
        loss, device = self.loss, self.loss.device
        pair = _FLAGS.get(device)
        if pair is None:
            pair = _FLAGS[device] = (torch.zeros(1, device=device), torch.ones(1, device=device))
        found, unit = pair
        found.zero_()  # reused every step: stream order keeps the last step's reads before this
        # the values of a sparse gradient are what it holds (unscaled in place with it)
        if self._pending is not None and inv_scale is not None:
            self.gradients()  # one kernel takes one factor: the 1/n first, then the loss scale's
        grads = [g if g.layout == torch.strided else g._values() for g in self._grads if g is not None]
        if self._pending is not None:
            factor = self._pending if isinstance(self._pending, torch.Tensor) else _FACTORS.get((device, self._pending))
            if factor is None:
                if len(_FACTORS) > 64:
                    _FACTORS.clear()
                factor = _FACTORS[(device, self._pending)] = torch.full((1,), self._pending, dtype=torch.float32,
                                                                        device=device)
            inv_scale = factor  # float32(1/n): the factor ``g.mul_(1/n)`` multiplies float32 by
            self._pending = None
        if inv_scale is None:
            torch._amp_foreach_non_finite_check_and_unscale_([loss.detach().view(1)] + grads + list(buffers),
                                                             found, unit)
            return found
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)
        torch._amp_foreach_non_finite_check_and_unscale_([loss.detach().view(1)] + list(buffers), found, unit)
        return found


# ------------------------------------------------------------ the fold
def add_into(grads: Pack, more: Pack) -> None:
    """``grads[i] += more[i]`` in place (owned sums), taking ``more[i]`` where ``grads[i]``
    has none yet. A dense gradient after a sparse sum becomes the sum, the sparse one
    added into it (torch cannot add dense into sparse in place; ``.grad`` accumulation does
    the same, and float addition commutes: the bits of ``sum + h``)."""
    for i, h in enumerate(more):
        if h is not None:
            g = grads[i]
            if g is None:
                grads[i] = h
            elif g.layout is not torch.strided and h.layout is torch.strided:
                grads[i] = h.add_(g)
            else:
                g.add_(h)


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
            drawn(runner, states, j)
        except (DataError, ConfigError) as e:
            raise type(e)(f"item {j}: {e}") from e  # which item of the batch
        yield pair
        del pair  # not held while the next item is differentiated


def sum_items(runner: Runner, batch: Sequence[Sample], leaves, scratch,
              states: Optional[list] = None) -> tuple[torch.Tensor, Pack]:
    """``fold`` over the items' gradients, differentiated one by one. From the second item
    on, each leaf's gradient is added into the sums as the backward produces it (a hook
    per leaf, ``accumulating``), so no item's whole gradient is ever held besides the sums,
    as ``.grad`` accumulation holds none; what a hook leaves (a slot the first item did not
    reach, a sparse or one-element gradient) is folded after the backward. The additions
    are the fold's (``sum.add_(g)``, in item order): the same bits."""
    pairs = item_gradients(runner, batch, leaves, scratch, states)
    loss, grads = next(pairs)
    if len(batch) == 1:
        return loss, grads
    handles = [] if runner.reentrant else accumulating(leaves, grads)  # a reentrant checkpoint's .grad route: fold
    try:
        for loss_k, grads_k in pairs:
            loss = add_losses(loss, loss_k)
            add_into(grads, grads_k)
            del grads_k  # gone before the next item is differentiated
    finally:
        for h in handles:
            h.remove()
    return loss, grads


def accumulating(leaves, sums: Pack) -> list:
    """Hooks adding each leaf's gradient into ``sums`` (its slots') as it is produced; the
    hook hands autograd a ``taken`` stand-in, which the item's result reads as ``None``.
    One hook per leaf tensor (tied slots sharing a leaf each get the gradient), only where
    every slot of the leaf has a dense sum to add into; a sparse or one-element gradient is
    returned as it is, for the fold."""
    by_leaf: dict = {}
    for k, t in enumerate(leaves):
        if t is not None:
            by_leaf.setdefault(id(t), (t, []))[1].append(k)
    handles = []
    for t, slots in by_leaf.values():
        if any(sums[k] is None or sums[k].layout is not torch.strided for k in slots):
            continue

        def add(g: torch.Tensor, slots=slots) -> torch.Tensor:
            if g.layout is not torch.strided or g.numel() <= 1:
                return g
            for k in slots:
                sums[k].add_(g)
            return taken(g)
        handles.append(t.register_hook(add))
    return handles


def draws(runner: Runner, states: Optional[list], j: int) -> None:
    """Put the generators where item ``j`` starts in one process (data parallel with a
    model that draws random numbers: every item draws its own numbers, wherever it runs)."""
    if states is not None:
        set_rng_state(runner.device, states[j])


def drawn(runner: Runner, states: Optional[list], j: int) -> None:
    """After item ``j``: where its start was counted rather than replayed
    (``draw_shift.Start``), its forward must have left the generators where the next item
    starts; a forward whose values decide how much it draws is refused by name."""
    then = None if states is None else getattr(states[j], "then", None)
    if then is not None and not same_rng(rng_state(runner.device), then):
        raise DataError(
            f"{states[j].op}: its forward drew another amount of random numbers than the first item of the same shapes "
            "(the values decide how much it draws), so where the items computed on other ranks start "
            "cannot be counted: train with item_seeds=True (each item's draws seeded for it), or with "
            "one process")


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
            drawn(runner, own, len(mine) - 1)
    finally:
        for h in handles:
            h.remove()
    if partial_loss is not None:
        loss = add_losses(partial_loss, loss)
    return reducer, loss, grads
