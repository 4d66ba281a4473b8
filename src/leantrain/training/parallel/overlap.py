"""Data parallel with communication overlapped with backward (DDP's reducer's schedule).

A rank sums its items' gradients left to right (``accumulate.sum_items``' fold); the sum
of all but the last item is ready before the last item's backward starts. During that
backward each trained leaf carries one gradient hook: when autograd hands over the
leaf's gradient for the last item, the hook writes ``partial + g`` (the very operation
the plain fold does, so the same bits) straight into the leaf's place in a flat bucket.
Buckets hold the leaves in reverse slot order (the order backward produces them), one
device and dtype each, closed once they pass 1 MiB (the first) or 25 MiB (the rest),
as ``DistributedDataParallel`` buckets parameters. A complete bucket is all-reduced
asynchronously at once, but strictly in bucket order, so every rank issues the same
collectives in the same order whatever order its hooks fire in; buckets of leaves the
backward never reached (unused, or a rank without items) are filled after it and sent
in order. The loss, when asked for, is one float64 all-reduce after the gradients (a
``LossSum``'s total and count, always: the count divides the gradients). The
hooks are removed when the backward ends, also on error. The result: the summed
gradients as views into the reduced buckets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import distributed
from ..runner.backward import taken

FIRST_BUCKET_BYTES = 1 << 20  # DDP's first bucket: small, so communication starts early
BUCKET_BYTES = 25 << 20  # DDP's bucket_cap_mb default


@dataclass
class BucketPlan:
    """Buckets as lists of ``(slot, offset, numel)``, with each bucket's size, device and dtype."""

    leaves: list  # the leaves the plan was made for (a binding's)
    buckets: list  # [(device, dtype, total, [(slot, offset, numel), ...])]
    where: dict  # slot -> (bucket, offset, numel)
    flats: Optional[list] = None  # the buckets' memory, kept across a loop's steps


def plan_buckets(leaves: list) -> BucketPlan:
    buckets: list = []
    current: Optional[list] = None
    for i in range(len(leaves) - 1, -1, -1):
        t = leaves[i]
        if t is None:
            continue
        cap = FIRST_BUCKET_BYTES if len(buckets) == 1 else BUCKET_BYTES
        if current is None or (current[0], current[1]) != (t.device, t.dtype) or current[2] * t.element_size() >= cap:
            current = [t.device, t.dtype, 0, []]  # a new bucket: another dtype, or the last one is full
            buckets.append(current)
        current[3].append((i, current[2], t.numel()))
        current[2] += t.numel()
    where = {i: (b, off, n) for b, bucket in enumerate(buckets) for i, off, n in bucket[3]}
    return BucketPlan(leaves, [tuple(b) for b in buckets], where)


def step_buckets(runner, leaves: list) -> tuple[BucketPlan, bool]:
    """The bucket plan of a step's leaves, kept on the loop's steady record while the
    leaves stay the same; and whether the buckets' memory may be reused (in a loop the
    step consumes the gradients before the next starts)."""
    steady = runner.loop.steady
    plan = None if steady is None else steady.buckets
    if plan is None or plan.leaves is not leaves:
        plan = plan_buckets(leaves)
        if steady is not None:
            steady.buckets = plan
    return plan, steady is not None


class Reducer:
    """The flat buckets of one step and their asynchronous all-reduces."""

    def __init__(self, plan: BucketPlan, partial: Optional[list], reuse: bool = False) -> None:
        """``reuse``: the plan's buckets from its previous step are written again (a loop
        whose step consumes the gradients before the next step starts); otherwise fresh."""
        self.plan, self.partial = plan, partial
        if reuse and plan.flats is not None:
            self.flats = plan.flats
        else:
            self.flats = [torch.empty(total, dtype=dtype, device=device) for device, dtype, total, _ in plan.buckets]
            if reuse:
                plan.flats = self.flats
        self.missing = [len(members) for *_, members in plan.buckets]
        self.filled: set[int] = set()
        self.works: list = []

    def _view(self, i: int, like: torch.Tensor) -> torch.Tensor:
        b, off, n = self.plan.where[i]
        return self.flats[b][off: off + n].view(like.shape)

    def fill(self, i: int, g: Optional[torch.Tensor]) -> None:
        """Slot ``i``'s summed gradient, ``partial[i] + g`` (or the one that exists, or
        zeros: under data parallel every rank sends every slot, so a slot no item of
        any rank used arrives as zeros), into its bucket."""
        if i in self.filled:
            return
        view = self._view(i, self.plan.leaves[i])
        before = None if self.partial is None else self.partial[i]
        with torch.no_grad():
            if g is not None and before is not None:
                torch.add(before, g, out=view)
            elif g is not None or before is not None:  # items that did not use the slot add nothing
                view.copy_(g if g is not None else before)
            else:
                view.zero_()
        self.filled.add(i)
        if before is not None:
            self.partial[i] = None  # the bucket holds the sum: the fold's partial goes
        self.missing[self.plan.where[i][0]] -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        """Start the all-reduce of every complete bucket whose predecessors have started."""
        while len(self.works) < len(self.flats) and self.missing[len(self.works)] == 0:
            flat = self.flats[len(self.works)]
            self.works.append(dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=distributed.group(), async_op=True))

    def hook(self, i: int) -> Callable:
        def on_gradient(g: torch.Tensor) -> torch.Tensor:
            self.fill(i, g)
            return taken(g)  # copied into its bucket: autograd's result need not keep it

        return on_gradient

    def send(self, grads: Optional[list]) -> None:
        """Fill what the hooks did not (from ``grads``, the step's own result, or zeros
        without items) and start the remaining all-reduces, in bucket order."""
        for i, t in enumerate(self.plan.leaves):
            if t is not None and i not in self.filled:
                self.fill(i, grads[i] if grads is not None else None)

    def finish(self, grads: Optional[list], loss: Optional[torch.Tensor]):
        """``send`` the rest, reduce ``loss`` (a scalar, or the float64 pair of a
        ``LossSum``'s total and count) after the gradients, wait; ``(the reduced loss
        as float64 values, or None; the reduced gradients as views into the buckets)``."""
        self.send(grads)
        total = None
        if loss is not None:
            total = loss.detach().to(torch.float64).reshape(-1).clone()
            self.works.append(dist.all_reduce(total, op=dist.ReduceOp.SUM, group=distributed.group(), async_op=True))
        for w in self.works:
            w.wait()
        out = [None if t is None else self._view(i, t) for i, t in enumerate(self.plan.leaves)]
        return total, out
