"""Sharding's reduce-scatter overlapped with the last item's backward.

The schedule of ``overlap.py`` (DDP's): a rank sums all its items but the last one
first; during the last backward a hook on each trained leaf forms the slot's sum
(``partial + g``, the fold's own operation, so the same bits; or the gradient alone) and a
bucket of leaves (reverse slot order, one device and dtype, 1 MiB then 25 MiB) is sent as
soon as it is complete, strictly in bucket order, so every rank posts the same transfers
in the same order. A bucket travels point to point: to each other rank, that rank's
ranges of the bucket's slots, each range of ``DIRECT`` bytes or more straight from the
slot's sum, the smaller ones concatenated in one message; each rank receives the others'
pieces of its own ranges into one buffer, laid out as they are sent. When the backward
ends the rest is sent, every transfer awaited, and each range summed over the ranks in
rank order: the same bits on every backend, with the communication under the backward
(``step.reduced`` sends the buckets of gradients summed without the overlap).

Memory: no send buffer holds a copy of the gradients (a bucket's ranges are cut from the
sums themselves), and with two ranks each range's sum is formed in the receive buffer,
over the peer's piece (float addition commutes: the same bits as in rank order). A slot's
sum is kept until its bucket's transfers end; at most ``IN_FLIGHT`` bytes of them are
outstanding: past that the oldest bucket is awaited and summed (in bucket order, as
``finish`` would) and its memory let go, so the reduce-scatter's memory stays bounded
whatever the model's size, while the backward still runs ahead of the transfers. A
parameter-sharding round's first two items are summed in one pass (``g0 + g1``: the same
bits as a copy of ``g0`` and ``+= g1``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import distributed
from ...runner.backward import taken
from ...update.mean import sum_hooked
from ..overlap import BucketPlan, step_buckets
from .comm import piece
from .plan import ShardPlan


# bytes: a range this large is sent alone, straight from its sum; smaller ones are concatenated
# (64 KiB, where the gathers' broadcasts use 1 MiB: a point-to-point message costs little, a
# copy of the ranges between costs their bytes; on 4 processes 0.89-0.91 of 1 MiB's time)
DIRECT = 64 << 10
IN_FLIGHT = 2 * 25 * 2**20  # bytes of sums a step leaves outstanding (two of DDP's large buckets)


class ShardReducer:
    """The buckets of one step and their point-to-point transfers."""

    def __init__(self, plan: ShardPlan, rank: int, bucket_plan: BucketPlan, partial: Optional[list],
                 into: Optional[dict] = None, present: Optional[list] = None) -> None:
        self.plan, self.rank, self.leaves, self.partial = plan, rank, bucket_plan.leaves, partial
        # ``into``: running sums per slot, across calls (parameter sharding's rounds of one
        # item per rank): each received piece is added to them in rank order, for the ranks in
        # ``present`` only (those that had an item this round), so the sums are the item-order fold
        self.into, self.present = into, present
        buckets = bucket_plan.buckets
        self.members = [[i for i, _, _ in members] for *_, members in buckets]
        self.kinds = [(device, dtype) for device, dtype, *_ in buckets]
        self.nbytes = [total * dtype.itemsize for _, dtype, total, _ in buckets]
        self.bucket_of = {i: b for b, ms in enumerate(self.members) for i in ms}
        self.missing = [len(ms) for ms in self.members]
        self.peers = [q for q in range(plan.world) if q != rank]
        self.filled: set = set()  # slots whose sum is formed
        self.sums: dict = {}  # slot -> its flat sum (``None``: zeros), until its bucket's transfers end
        self.sent: list = []  # per bucket in order: (transfers, tensors sent, received, this rank's size, bytes)
        self.done = 0  # buckets awaited and summed, in order
        self.out: list = [None] * len(self.leaves)  # this rank's summed ranges, per slot
        self.zeros: dict = {}  # (device, dtype) -> zeros sent for a slot nobody filled

    def fill(self, i: int, g: Optional[torch.Tensor]) -> None:
        """Slot ``i``'s summed gradient (``partial[i] + g``, or the one that exists, or
        zeros), kept flat until its bucket is sent and received."""
        if i in self.filled:
            return
        self.filled.add(i)
        before = None if self.partial is None else self.partial[i]
        with torch.no_grad():
            if g is not None and before is not None:
                s = torch.add(before.reshape(-1), g.detach().reshape(-1))  # the fold's addition
            elif g is not None or before is not None:
                s = (g if g is not None else before).detach().reshape(-1)
            else:
                s = None
        self.sums[i] = s
        if self.partial is not None:
            self.partial[i] = None
        self.missing[self.bucket_of[i]] -= 1
        while len(self.sent) < len(self.members) and self.missing[len(self.sent)] == 0:
            self._send(len(self.sent))

    def _layout(self, b: int, q: int) -> tuple[list, int, int]:
        """Rank ``q``'s ranges of bucket ``b``'s slots as they travel to ``q``: the small
        ones first (slot order, one message), then each large one alone; as
        ``[(slot, range, offset)]``, the small ones' elements and all the elements."""
        small, large = [], []
        size = self.kinds[b][1].itemsize
        for i in self.members[b]:
            own = self.plan.range_of(i, q)
            if own is not None and own.size:
                (large if own.size * size >= DIRECT else small).append((i, own))
        placed, at = [], 0
        for i, own in small + large:
            placed.append((i, own, at))
            at += own.size
        return placed, sum(own.size for _, own in small), at

    def _piece(self, i: int, own) -> torch.Tensor:
        """This rank's part of range ``own`` of slot ``i``: cut from its sum, or zeros."""
        s = self.sums[i]
        if s is not None:
            return piece(s, own, self.plan.sizes[i])
        kind = self.kinds[self.bucket_of[i]]
        z = self.zeros.get(kind)
        if z is None or z.numel() < own.size:
            z = self.zeros[kind] = torch.zeros(own.size, dtype=kind[1], device=kind[0])
        return z[: own.size]

    def _send(self, b: int) -> None:
        device, dtype = self.kinds[b]
        group, ops, held = distributed.group(), [], []
        for q in self.peers:  # to each rank its ranges: the small ones together, the large ones alone
            placed, small, _ = self._layout(b, q)
            pieces = [self._piece(i, own) for i, own, _ in placed]
            k = sum(1 for _, _, at in placed if at < small)
            sends = ([torch.cat(pieces[:k])] if k else []) + pieces[k:]
            ops.extend(dist.P2POp(dist.isend, t, self._global(q), group) for t in sends)
            held.extend(sends)
        placed, small, mine = self._layout(b, self.rank)
        received = torch.empty(mine * len(self.peers), dtype=dtype, device=device)
        for k, q in enumerate(self.peers):  # the others' pieces of this rank's ranges, as they are sent
            chunk = received[k * mine: (k + 1) * mine]
            receives = ([chunk[:small]] if small else []) + [chunk[at: at + own.size] for _, own, at in placed
                                                              if at >= small]
            ops.extend(dist.P2POp(dist.irecv, t, self._global(q), group) for t in receives)
        # one batch: NCCL runs it as one group (no rank's send waits on a receive not yet posted)
        transfers = dist.batch_isend_irecv(ops) if ops else []
        self.sent.append((transfers, held, received, mine, self.nbytes[b]))
        while sum(x[4] for x in self.sent[self.done:]) > IN_FLIGHT and self.done < b:
            self._complete(self.done)  # the oldest transfer first: bounded memory

    @staticmethod
    def _global(q: int) -> int:
        """Rank ``q`` of leantrain's group as the default group numbers it (p2p's ranks)."""
        group = distributed.group()
        return q if group is None else dist.get_global_rank(group, q)

    def hook(self, i: int):
        def on_gradient(g: torch.Tensor) -> torch.Tensor:
            self.fill(i, g)
            return taken(g)  # the sum holds it now: autograd's result need not keep it

        return on_gradient

    def finish(self, grads: Optional[list]) -> list:
        """Fill what the hooks did not (from ``grads``, or zeros without items), send the
        rest in order, wait, and sum each range over the ranks in rank order."""
        for i, t in enumerate(self.leaves):
            if t is not None and i not in self.filled:
                self.fill(i, grads[i] if grads is not None else None)
        while self.done < len(self.sent):
            self._complete(self.done)
        return self.out

    def _complete(self, b: int) -> None:
        """Await bucket ``b`` (the oldest outstanding) and sum each of this rank's ranges
        over the ranks in rank order; its sums and buffers go."""
        transfers, _, received, mine, _ = self.sent[b]  # the sent tensors are let go with the entry
        self.sent[b] = (None, None, None, 0, 0)
        self.done += 1
        for t in transfers:
            t.wait()
        device, dtype = self.kinds[b]
        # with two ranks the sums are formed in the receive buffer, each over the peer's piece
        summed = received if len(self.peers) == 1 else None
        placed, _, _ = self._layout(b, self.rank)
        for i, own, at in placed:
            parts = [received[k * mine + at: k * mine + at + own.size] for k in range(len(self.peers))]
            parts.insert(self.rank, self._piece(i, own))  # rank order
            if summed is None and (self.into is None or self.into.get(i) is None):
                summed = torch.empty(mine, dtype=dtype, device=device)
            if self.into is None:
                self.out[i] = self._sum(parts, range(self.plan.world), summed[at: at + own.size])
                continue
            present, acc = list(self.present), self.into.get(i)
            if acc is None:
                acc = self.into[i] = self._sum(parts, present[:2], summed[at: at + own.size])
                present = present[2:]
            for q in present:  # this round's other items, in item order
                acc.add_(parts[q])  # the fold's additions: g0 + g1, then + g2
            self.out[i] = acc
        for i in self.members[b]:
            self.sums.pop(i, None)
            own = self.plan.range_of(i, self.rank)
            if own is not None and not own.size:
                self.out[i] = torch.zeros(0, dtype=dtype, device=device)

    @staticmethod
    def _sum(parts: list, ranks, into: torch.Tensor) -> torch.Tensor:
        """``parts`` of ``ranks`` summed left to right into ``into`` (which may be one
        of them: the first two are added in one pass, and addition commutes)."""
        ranks = list(ranks)
        if len(ranks) == 1:
            return into.copy_(parts[ranks[0]])  # the first item's own values
        torch.add(parts[ranks[0]], parts[ranks[1]], out=into)
        for q in ranks[2:]:
            into.add_(parts[q])  # left to right over the ranks
        return into


def overlapped_ranges(runner, leaves, scratch, mine: list, own: Optional[list], plan: ShardPlan, rank: int):
    """This rank's items' loss sum and the reduce-scattered ranges, the last item's
    backward overlapping the sends (exact accumulation; ``None`` loss without items)."""
    buckets, _ = step_buckets(runner, leaves)
    if not mine:
        return None, ShardReducer(plan, rank, buckets, None).finish(None)
    reducer, loss, grads = sum_hooked(runner, mine, leaves, scratch, own,
                                      lambda partial: ShardReducer(plan, rank, buckets, partial))
    return loss, reducer.finish(grads)
