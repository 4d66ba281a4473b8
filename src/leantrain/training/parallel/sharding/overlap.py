"""Sharding's reduce-scatter overlapped with the last item's backward.

The schedule of ``overlap.py`` (DDP's): a rank sums all its items but the last one
first; during the last backward a hook on each trained leaf writes ``partial + g`` (the
fold's own operation, so the same bits) and a bucket of leaves (reverse slot order, one
device and dtype, 1 MiB then 25 MiB) is sent as soon as it is complete, strictly in
bucket order, so every rank issues the same collectives in the same order. A bucket's
send is an ``all_to_all_single``: to each rank, that rank's ranges of the bucket's
slots. When the backward ends the rest is sent, every transfer awaited, and each range
summed over the ranks in rank order (``shard_comm``'s rule): the ranges
``shard_comm.reduce_scatter`` gives, bit for bit, with the communication under the
backward.

Memory: each slot's sum (``partial + g``, the fold's addition, or the gradient alone) is
written by its hook straight into the bucket's send buffer, every rank's range at its
place, and the gradient and the partial sum are let go at once: nothing is concatenated
when the bucket is complete. At most ``IN_FLIGHT`` bytes of sends are outstanding: past
that the oldest bucket is awaited and summed (in bucket order, as ``finish`` would) and
its buffers let go, so the reduce-scatter's buffers stay bounded whatever the model's
size, while the backward still runs ahead of the transfers. A parameter-sharding round's
first two items are summed in one pass (``g0 + g1``: the same bits as a copy of ``g0``
and ``+= g1``).
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


IN_FLIGHT = 2 * 25 * 2**20  # bytes of sends a step leaves outstanding (two of DDP's large buckets)


class ShardReducer:
    """The buckets of one step and their asynchronous all-to-alls."""

    def __init__(self, plan: ShardPlan, rank: int, bucket_plan: BucketPlan, partial: Optional[list],
                 into: Optional[dict] = None, present: Optional[list] = None) -> None:
        self.plan, self.rank, self.leaves, self.partial = plan, rank, bucket_plan.leaves, partial
        # ``into``: running sums per bucket, across calls (parameter sharding's rounds of one
        # item per rank): each received piece is added to them in rank order, for the ranks in
        # ``present`` only (those that had an item this round), so the sums are the item-order fold
        self.into, self.present = into, present
        buckets = bucket_plan.buckets
        self.members = [[i for i, _, _ in members] for *_, members in buckets]
        self.kinds = [(device, dtype) for device, dtype, *_ in buckets]
        self.bucket_of = {i: b for b, ms in enumerate(self.members) for i in ms}
        self.missing = [len(ms) for ms in self.members]
        self.filled: set = set()  # slots written into their bucket's send buffer
        self.sends: dict = {}  # bucket -> (send buffer, places per slot, elements per rank), until sent
        self.sent: list = []  # per bucket in order: (work, received, this rank's size, bytes sent)
        self.done = 0  # buckets awaited and summed, in order
        self.out: list = [None] * len(self.leaves)  # this rank's summed ranges, per slot

    def fill(self, i: int, g: Optional[torch.Tensor]) -> None:
        """Slot ``i``'s summed gradient (``partial[i] + g``, or the one that exists, or
        zeros), written straight into its places in the bucket's send buffer, rank after
        rank: the gradient goes at once and nothing is concatenated when the bucket is sent."""
        if i in self.filled:
            return
        self.filled.add(i)
        b = self.bucket_of[i]
        send, places = self._buffer(b)
        before = None if self.partial is None else self.partial[i]
        size = self.plan.sizes[i]
        with torch.no_grad():
            for own, at in places[i]:
                into = send[at: at + own.size]
                if g is not None and before is not None:
                    torch.add(piece(before, own, size), piece(g.detach(), own, size), out=into)  # the fold's addition
                elif g is not None or before is not None:
                    into.copy_(piece((g if g is not None else before).detach(), own, size))
                else:
                    into.zero_()
        if self.partial is not None:
            self.partial[i] = None
        self.missing[b] -= 1
        while len(self.sent) < len(self.members) and self.missing[len(self.sent)] == 0:
            self._send(len(self.sent))

    def _buffer(self, b: int) -> tuple:
        """Bucket ``b``'s send buffer (made when its first slot arrives) and, per member
        slot, where each rank's range of it goes."""
        if b not in self.sends:
            device, dtype = self.kinds[b]
            places: dict = {i: [] for i in self.members[b]}
            splits, at = [], 0
            for r in range(self.plan.world):
                sent = 0
                for i in self.members[b]:
                    own = self.plan.range_of(i, r)
                    if own is None or own.size == 0:
                        continue
                    places[i].append((own, at + sent))
                    sent += own.size
                splits.append(sent)
                at += sent
            self.sends[b] = (torch.empty(at, dtype=dtype, device=device), places, splits)
        return self.sends[b][:2]

    def _send(self, b: int) -> None:
        device, dtype = self.kinds[b]
        send, _, splits = self.sends.pop(b)  # made by the bucket's first fill (a bucket has members)
        mine = splits[self.rank]
        received = torch.empty(mine * self.plan.world, dtype=dtype, device=device)
        work = dist.all_to_all_single(received, send, [mine] * self.plan.world, splits, group=distributed.group(),
                                      async_op=True)
        self.sent.append((work, received, mine, send.numel() * send.element_size()))
        while sum(x[3] for x in self.sent[self.done:]) > IN_FLIGHT and self.done < b:
            self._complete(self.done)  # the oldest transfer first: bounded buffers

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
        over the ranks in rank order; its buffers go."""
        work, received, mine, _ = self.sent[b]
        self.sent[b] = (None, None, 0, 0)
        self.done += 1
        work.wait()
        chunks = received.split(mine) if mine else [received] * self.plan.world
        if self.into is not None:
            summed, present = self.into.get(b), list(self.present)
            if summed is None and len(present) > 1:  # the first two items' sum, written once
                summed = self.into[b] = chunks[present[0]] + chunks[present[1]]
                present = present[2:]
            elif summed is None and present:
                summed = self.into[b] = chunks[present.pop(0)].clone()  # the first item's own values
            for q in present:  # this round's other items, in item order
                summed.add_(chunks[q])  # the fold's additions: g0 + g1, then + g2
        else:
            summed = chunks[0] + chunks[1] if mine else received
            for c in chunks[2:] if mine else ():
                summed.add_(c)  # left to right over the ranks
        offset = 0
        for i in self.members[b]:
            own = self.plan.range_of(i, self.rank)
            if own is not None:
                self.out[i] = summed[offset: offset + own.size]
                offset += own.size


def overlapped_ranges(runner, leaves, scratch, mine: list, own: Optional[list], plan: ShardPlan, rank: int):
    """This rank's items' loss sum and the reduce-scattered ranges, the last item's
    backward overlapping the sends (exact accumulation; ``None`` loss without items)."""
    buckets, _ = step_buckets(runner, leaves)
    if not mine:
        return None, ShardReducer(plan, rank, buckets, None).finish(None)
    reducer, loss, grads = sum_hooked(runner, mine, leaves, scratch, own,
                                      lambda partial: ShardReducer(plan, rank, buckets, partial))
    return loss, reducer.finish(grads)
