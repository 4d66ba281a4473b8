"""The exact reduction's fold in bounded memory: each item's gradient sent in ranges to
their owners, one round of items at a time, each owner folding its range in item order.

Item ``j`` of an update's ``n`` is differentiated on rank ``j mod world``, in rounds of
``world`` items (round ``r`` holds items ``r*world`` to ``r*world + world - 1``). In each
round every rank cuts its item's flat gradient (zeros where it used no slot, or has no item)
into ``SEGMENTS`` segments, each into ``world`` ranges, and sends range ``c`` of each segment
to rank ``c`` (one all-to-all per segment and gradient dtype); rank ``c`` adds the round's
ranges to its running sums in item order. After the
last round the ranks all-gather their summed ranges, each segment straight into its place
in the whole gradient. Every element is the same sequence of additions as one process's
left-to-right fold (``accumulate.fold``: ``g0 + g1``, then ``+ g2``...), so the bits are
the same on any number of ranks; but a rank holds one item's gradient (each slot let go
once its last segment is sent), a segment in flight both ways and its share of the sum:
at most one process's two packs (the sum and one item's), never every item's as a
gather of all items would (``n`` packs per rank). The items' losses travel together at
the end (as float64: exact for every narrower float and for counts below 2**53).
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.distributed as dist

from . import distributed
from ...samples import LossSum


def _buckets(leaves: list) -> dict[tuple, list[tuple[int, torch.Tensor]]]:
    out: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
    for i, t in enumerate(leaves):
        if t is not None:
            out.setdefault((t.device, t.dtype), []).append((i, t))
    return out


# torch's newer name for the same collective (the older one warns there; torch >= 2.4 has one of them)
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
SEGMENTS = 4  # each round's gradient crosses in this many pieces: a quarter of a pack in flight at a time


def owner_fold(pairs: Iterator, n: int, rank: int, world: int, leaves: list) -> tuple[list, list, Optional[object]]:
    """``(item losses in item order, summed gradient pack, this rank's first loss)`` from
    ``pairs``, this rank's items' ``(loss, pack)`` in order, computed lazily round by round.

    Each bucket's flat gradient is cut into ``SEGMENTS`` segments of ``seg = world * sub``
    elements (the last padded with zeros), each segment into ``world`` ranges of ``sub``:
    rank ``c`` owns range ``c`` of every segment and keeps their sums side by side
    (``SEGMENTS * sub`` elements)."""
    group = distributed.group()
    rows = -(-n // world)
    buckets = _buckets(leaves)
    layout = {}
    for key, members in buckets.items():
        width = sum(t.numel() for _, t in members)
        sub = -(-width // (SEGMENTS * world))
        layout[key] = (width, sub * world, sub)  # a segment is world ranges exactly: gathered in place
    sums: dict[tuple, Optional[torch.Tensor]] = {key: None for key in buckets}
    device = next((t.device for t in leaves if t is not None), torch.device("cpu"))
    loss_rows = torch.zeros(rows, 2, dtype=torch.float64, device=device)
    first = None
    for r in range(rows):
        pair = next(pairs) if r * world + rank < n else None
        grads = None
        if pair is not None:
            loss, grads = pair
            pair = None
            first = loss if first is None else first
            loss_row(loss_rows, r, loss)
        for key, members in buckets.items():
            width, seg, sub = layout[key]
            if sums[key] is None:
                sums[key] = torch.empty(SEGMENTS * sub, dtype=key[1], device=key[0])
            for s in range(SEGMENTS):
                part = _segment(grads, members, s * seg, min((s + 1) * seg, width), sub * world, key)
                _free_used(grads, members, (s + 1) * seg)  # slots wholly sent: gone
                received = torch.empty(sub * world, dtype=key[1], device=key[0])
                dist.all_to_all_single(received, part, group=group)  # equal splits: range c to rank c
                part = None
                received = received.split(sub)
                mine = sums[key][s * sub: (s + 1) * sub]
                for k in range(world):  # this round's items, in item order
                    j = r * world + k
                    if j >= n:
                        break
                    if j == 0:
                        mine.copy_(received[k])  # the first item's own values
                    else:
                        mine.add_(received[k])  # the same IEEE additions as g0 + g1, then add_
                received = None
        grads = None  # this item's gradients are folded: freed before the next is computed
    packs: list = [None] * len(leaves)
    for key, members in buckets.items():
        width, seg, sub = layout[key]
        # element (segment s, owner c, offset e) sits at flat position s*seg + c*sub + e: each
        # segment's all-gather writes the owners' ranges into their places, no copy after
        full = torch.empty(SEGMENTS * seg, dtype=key[1], device=key[0])
        for s in range(SEGMENTS):
            ALL_GATHER(full[s * seg: (s + 1) * seg], sums[key][s * sub: (s + 1) * sub], group=group)
        sums[key] = None
        at = 0
        for i, t in members:
            packs[i] = full[at: at + t.numel()].view(t.shape)
            at += t.numel()
    return item_losses(loss_rows, n, world, first), packs, first


def loss_row(loss_rows: torch.Tensor, r: int, loss) -> None:
    """Row ``r`` of this rank's item losses: the loss (a ``LossSum``'s total) and its
    count (``-1``: a scalar loss), as float64 (exact for every narrower float)."""
    sums_loss = isinstance(loss, LossSum)
    loss_rows[r, 0] = (loss.total if sums_loss else loss).detach().to(torch.float64)
    loss_rows[r, 1] = torch.as_tensor(loss.count, device=loss_rows.device).to(torch.float64) if sums_loss else -1.0


def item_losses(loss_rows: torch.Tensor, n: int, world: int, first) -> list:
    """Every rank's rows gathered: the ``n`` item losses in item order (item ``j`` is row
    ``j // world`` of rank ``j mod world``)."""
    gathered_losses = [torch.empty_like(loss_rows) for _ in range(world)]
    dist.all_gather(gathered_losses, loss_rows, group=distributed.group())
    rows_of = [gathered_losses[j % world][j // world] for j in range(n)]
    sums_loss = bool(rows_of[0][1] >= 0) if first is None else isinstance(first, LossSum)  # intentional sync:
    # only on a rank without items, to learn the losses' kind from item 0
    return [LossSum(x[0], x[1]) for x in rows_of] if sums_loss else [x[0] for x in rows_of]


def _segment(grads, members, lo: int, hi: int, size: int, key) -> torch.Tensor:
    """Flat positions ``[lo, hi)`` of the item's gradient (zeros where it used no slot, or
    has no item), padded with zeros to ``size``."""
    if grads is None:
        return torch.zeros(size, dtype=key[1], device=key[0])
    part = torch.empty(size, dtype=key[1], device=key[0])
    part[hi - lo:].zero_()  # the last segment's padding
    at = 0
    for i, t in members:
        a, b = max(at, lo), min(at + t.numel(), hi)
        if a < b:
            if grads[i] is not None:
                part[a - lo: b - lo] = grads[i].reshape(-1)[a - at: b - at]
            else:
                part[a - lo: b - lo].zero_()  # a slot this item did not use
        at += t.numel()
    return part


def _free_used(grads, members, upto: int) -> None:
    """Let go of the item's gradients at slots whose flat positions all lie below ``upto``
    (sent already)."""
    if grads is not None:
        at = 0
        for i, t in members:
            at += t.numel()
            if at <= upto:
                grads[i] = None
