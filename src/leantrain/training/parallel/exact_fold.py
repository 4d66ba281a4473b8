"""The exact reduction's fold in bounded memory: each item's gradient sent in ranges to
their owners, one round of items at a time, each owner folding its range in item order.

Item ``j`` of an update's ``n`` is differentiated on rank ``j mod world``, in rounds of
``world`` items (round ``r`` holds items ``r*world`` to ``r*world + world - 1``). In each
round every rank cuts its item's flat gradient (zeros where it used no slot, or has no item)
into segments of at most ``SEGMENT_BYTES``, each into ``world`` ranges, and sends range
``c`` of each segment to rank ``c`` (one asynchronous all-to-all per segment and gradient
dtype); rank ``c`` adds the round's ranges to its running sums in item order. One segment
crosses while the next is cut, and a round's last one while the next item is
differentiated (``_Flight``). After the last round the ranks all-gather their summed
ranges, each segment straight into its place in the whole gradient. Every element is the
same sequence of additions as one process's left-to-right fold (``accumulate.fold``:
``g0 + g1``, then ``+ g2``...), so the bits are the same on any number of ranks; but a rank
holds one item's gradient (each slot let go once its last segment is cut), two segments
both ways and its share of the sum: at most one process's two packs (the sum and one
item's) for a model of more than ``4 * SEGMENT_BYTES`` on two ranks, never every item's as a
gather of all items would (``n`` packs per rank). The items' losses travel together at
the end (as float64: exact for every narrower float and for counts below 2**53).
"""

from __future__ import annotations

from collections import deque
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
SEGMENT_BYTES = 8 << 20  # a round's gradient crosses in segments of at most this size (all ranks' ranges)


class _Flight:
    """The segments sent and not yet folded, oldest first, with their buffers (a send and a
    receive buffer of one segment each): one segment crosses while the next is cut, and the
    round's last one while the next item is differentiated. A rank holds at most two
    segments' buffers, and one between rounds, however many rounds."""

    def __init__(self, n: int, world: int, sums: dict) -> None:
        self.n, self.world, self.sums = n, world, sums
        self.pending: deque = deque()
        self.spare: Optional[tuple] = None  # the buffers of the segment last folded

    def buffers(self, key, seg: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A (send, receive) pair of ``seg`` elements for bucket ``key``: the spare pair
        when it fits, else new ones; an earlier segment still in flight is folded first."""
        while len(self.pending) > 1:
            self.land()  # at most one segment in flight besides the one about to be cut
        spare, self.spare = self.spare, None
        if spare is not None and spare[0].dtype == key[1] and spare[0].device == key[0] and spare[0].numel() == seg:
            return spare
        return torch.empty(seg, dtype=key[1], device=key[0]), torch.empty(seg, dtype=key[1], device=key[0])

    def send(self, key, s: int, r: int, sub: int, part: torch.Tensor, received: torch.Tensor, group) -> None:
        # equal splits: range c of the segment to rank c; asynchronous, folded when it lands
        work = dist.all_to_all_single(received, part, group=group, async_op=True)
        self.pending.append((key, s, r, sub, part, received, work))

    def land(self) -> None:
        """Wait for the oldest segment in flight and add its ranges to this rank's sums,
        in item order (the same IEEE additions as ``g0 + g1``, then ``add_``)."""
        key, s, r, sub, part, received, work = self.pending.popleft()
        work.wait()
        mine = self.sums[key][s * sub: (s + 1) * sub]
        for k, rng in enumerate(received.split(sub)):  # this round's items, in item order
            j = r * self.world + k
            if j >= self.n:
                break
            if j == 0:
                mine.copy_(rng)  # the first item's own values
            else:
                mine.add_(rng)
        self.spare = (part, received)

    def between_rounds(self) -> None:
        """Let go of the spare buffers: while the next item is differentiated a rank holds
        only the segment still crossing."""
        self.spare = None

    def drain(self) -> None:
        while self.pending:
            self.land()


def owner_fold(pairs: Iterator, n: int, rank: int, world: int, leaves: list) -> tuple[list, list, Optional[object]]:
    """``(item losses in item order, summed gradient pack, this rank's first loss)`` from
    ``pairs``, this rank's items' ``(loss, pack)`` in order, computed lazily round by round.

    Each bucket's flat gradient is cut into ``count`` segments of ``seg = world * sub``
    elements (at most ``SEGMENT_BYTES``; the last padded with zeros), each segment into
    ``world`` ranges of ``sub``: rank ``c`` owns range ``c`` of every segment and keeps
    their sums side by side (``count * sub`` elements). Segments cross asynchronously
    (``_Flight``): the next is cut, and the next item differentiated, while one crosses."""
    group = distributed.group()
    rows = -(-n // world)
    buckets = _buckets(leaves)
    layout = {}
    for key, members in buckets.items():
        width = sum(t.numel() for _, t in members)
        count = max(1, -(-width * key[1].itemsize // SEGMENT_BYTES))
        sub = -(-width // (count * world))
        layout[key] = (width, sub * world, sub, count)  # a segment is world ranges exactly: gathered in place
    sums = {key: torch.empty(layout[key][3] * layout[key][2], dtype=key[1], device=key[0]) for key in buckets}
    device = next((t.device for t in leaves if t is not None), torch.device("cpu"))
    loss_rows = torch.zeros(rows, 2, dtype=torch.float64, device=device)
    flight = _Flight(n, world, sums)
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
            width, seg, sub, count = layout[key]
            for s in range(count):
                part, received = flight.buffers(key, seg)
                _segment(part, grads, members, s * seg, min((s + 1) * seg, width))
                _free_used(grads, members, (s + 1) * seg)  # slots wholly copied out: gone
                flight.send(key, s, r, sub, part, received, group)
        grads = None  # this item's gradients are on their way: freed before the next is computed
        flight.between_rounds()
    flight.drain()
    packs: list = [None] * len(leaves)
    works = []
    for key, members in buckets.items():
        width, seg, sub, count = layout[key]
        # element (segment s, owner c, offset e) sits at flat position s*seg + c*sub + e: each
        # segment's all-gather writes the owners' ranges into their places, no copy after
        full = torch.empty(count * seg, dtype=key[1], device=key[0])
        for s in range(count):
            works.append(ALL_GATHER(full[s * seg: (s + 1) * seg], sums[key][s * sub: (s + 1) * sub], group=group,
                                    async_op=True))
        at = 0
        for i, t in members:
            packs[i] = full[at: at + t.numel()].view(t.shape)
            at += t.numel()
    losses = item_losses(loss_rows, n, world, first)
    for w in works:
        w.wait()
    return losses, packs, first


def loss_row(loss_rows: torch.Tensor, r: int, loss) -> None:
    """Row ``r`` of this rank's item losses: the loss (a ``LossSum``'s total) and its
    count (``-1``: a scalar loss), as float64 (exact for every narrower float)."""
    sums_loss = isinstance(loss, LossSum)
    loss_rows[r, 0] = (loss.total if sums_loss else loss).detach().to(torch.float64)
    count = loss.count if sums_loss else -1.0
    if isinstance(count, torch.Tensor):
        loss_rows[r, 1] = count.to(loss_rows.device, torch.float64)
    else:  # a number: written by a kernel, never copied from host memory (a sync on a GPU)
        loss_rows[r, 1].fill_(float(count))


def item_losses(loss_rows: torch.Tensor, n: int, world: int, first) -> list:
    """Every rank's rows gathered: the ``n`` item losses in item order (item ``j`` is row
    ``j // world`` of rank ``j mod world``)."""
    gathered_losses = [torch.empty_like(loss_rows) for _ in range(world)]
    dist.all_gather(gathered_losses, loss_rows, group=distributed.group())
    rows_of = [gathered_losses[j % world][j // world] for j in range(n)]
    sums_loss = bool(rows_of[0][1] >= 0) if first is None else isinstance(first, LossSum)  # intentional sync:
    # only on a rank without items, to learn the losses' kind from item 0
    return [LossSum(x[0], x[1]) for x in rows_of] if sums_loss else [x[0] for x in rows_of]


def _segment(part: torch.Tensor, grads, members, lo: int, hi: int) -> None:
    """Flat positions ``[lo, hi)`` of the item's gradient (zeros where it used no slot, or
    has no item) into ``part``, padded with zeros to its end."""
    if grads is None:
        part.zero_()
        return
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


def _free_used(grads, members, upto: int) -> None:
    """Let go of the item's gradients at slots whose flat positions all lie below ``upto``
    (sent already)."""
    if grads is not None:
        at = 0
        for i, t in members:
            at += t.numel()
            if at <= upto:
                grads[i] = None
