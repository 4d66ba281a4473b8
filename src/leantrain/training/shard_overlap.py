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
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import distributed
from .accumulate import sum_hooked
from .overlap import BucketPlan, step_buckets
from .shard_comm import piece
from .shard_plan import ShardPlan


class ShardReducer:
    """The buckets of one step and their asynchronous all-to-alls."""

    def __init__(self, plan: ShardPlan, rank: int, bucket_plan: BucketPlan, partial: Optional[list]) -> None:
        self.plan, self.rank, self.leaves, self.partial = plan, rank, bucket_plan.leaves, partial
        buckets = bucket_plan.buckets
        self.members = [[i for i, _, _ in members] for *_, members in buckets]
        self.kinds = [(device, dtype) for device, dtype, *_ in buckets]
        self.bucket_of = {i: b for b, ms in enumerate(self.members) for i in ms}
        self.missing = [len(ms) for ms in self.members]
        self.sums: dict = {}
        self.sent: list = []  # per bucket in order: (work, received, this rank's size)

    def fill(self, i: int, g: Optional[torch.Tensor]) -> None:
        """Slot ``i``'s summed gradient (``partial[i] + g``, or the one that exists)."""
        if i in self.sums:
            return
        before = None if self.partial is None else self.partial[i]
        with torch.no_grad():
            self.sums[i] = before + g if g is not None and before is not None else (g if g is not None else before)
        b = self.bucket_of[i]
        self.missing[b] -= 1
        while len(self.sent) < len(self.members) and self.missing[len(self.sent)] == 0:
            self._send(len(self.sent))

    def _send(self, b: int) -> None:
        device, dtype = self.kinds[b]
        parts, splits = [], []
        for r in range(self.plan.world):
            sent = 0
            for i in self.members[b]:
                own = self.plan.range_of(i, r)
                if own is None or own.size == 0:
                    continue
                g = self.sums[i]
                parts.append(torch.zeros(own.size, dtype=dtype, device=device) if g is None
                             else piece(g.detach(), own, self.plan.sizes[i]))
                sent += own.size
            splits.append(sent)
        mine = splits[self.rank]
        received = torch.empty(mine * self.plan.world, dtype=dtype, device=device)
        send = torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=device)
        work = dist.all_to_all_single(received, send, [mine] * self.plan.world, splits, group=distributed.group(),
                                      async_op=True)
        self.sent.append((work, received, mine))

    def hook(self, i: int):
        def on_gradient(g: torch.Tensor) -> None:
            self.fill(i, g)
            return None  # the gradient itself is left as autograd made it

        return on_gradient

    def finish(self, grads: Optional[list]) -> list:
        """Fill what the hooks did not (from ``grads``, or zeros without items), send the
        rest in order, wait, and sum each range over the ranks in rank order."""
        for i, t in enumerate(self.leaves):
            if t is not None and i not in self.sums:
                self.fill(i, grads[i] if grads is not None else None)
        out: list = [None] * len(self.leaves)
        for b, (work, received, mine) in enumerate(self.sent):
            work.wait()
            chunks = received.split(mine) if mine else [received] * self.plan.world
            summed = chunks[0] + chunks[1] if mine else received
            for c in chunks[2:] if mine else ():
                summed.add_(c)  # left to right over the ranks
            offset = 0
            for i in self.members[b]:
                own = self.plan.range_of(i, self.rank)
                if own is not None:
                    out[i] = summed[offset: offset + own.size]
                    offset += own.size
        return out


def overlapped_ranges(runner, leaves, scratch, mine: list, own: Optional[list], plan: ShardPlan, rank: int):
    """This rank's items' loss sum and the reduce-scattered ranges, the last item's
    backward overlapping the sends (exact accumulation; ``None`` loss without items)."""
    buckets, _ = step_buckets(runner, leaves)
    if not mine:
        return None, ShardReducer(plan, rank, buckets, None).finish(None)
    reducer, loss, grads = sum_hooked(runner, mine, leaves, scratch, own,
                                      lambda partial: ShardReducer(plan, rank, buckets, partial))
    return loss, reducer.finish(grads)
