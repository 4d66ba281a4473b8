"""One gather of released parameter storages, in flight until it lands.

``Fetch`` resizes nothing itself: the storages it is given hold memory already. It writes
this rank's own ranges into them at once and starts asynchronous broadcasts of the
owners' ranges (every rank knows every range from the plan, so nothing else is sent): a
range of ``DIRECT`` bytes or more is broadcast straight into its place in the storage,
smaller ones of one owner, device and dtype travel concatenated in one buffer (one call
instead of many: a layer norm's ranges are a few hundred bytes). ``land`` waits for them
and copies the concatenated ranges into place. Between the two the storages hold memory
but not yet all their values: the owner of the fetch (``gathering.py``) lands it before
anything reads them and never releases a storage with a fetch in flight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import distributed
from .plan import ShardPlan

DIRECT = 1 << 20  # bytes: a range this large is broadcast into its place, smaller ones concatenated


class Fetch:
    """The storages of slots ``slots`` (released ones) being gathered from their owners."""

    def __init__(self, plan: ShardPlan, rank: int, slots: list, full: list, values: dict, views: dict) -> None:
        self.slots, self.views = slots, views  # views: per slot, a flat tensor of its own over the storage
        self.transfers: list = []
        wanted = set(slots)
        ranges = [r for r in plan.ranges if r.slot in wanted and r.size]
        with torch.no_grad():
            for r in ranges:
                if r.rank == rank:
                    views[r.slot][r.start: r.stop].copy_(values[r])  # this rank's own, at once
        if plan.world == 1:
            return
        groups: dict = {}
        for r in ranges:  # plan order: every rank issues the same broadcasts in the same order
            t = full[r.slot]
            if r.size * t.element_size() >= DIRECT:
                target = values[r] if r.rank == rank else views[r.slot][r.start: r.stop]
                self.transfers.append((dist.broadcast(target, src=r.rank, group=distributed.group(), async_op=True),
                                       None, ()))
            else:
                groups.setdefault((r.rank, t.device, t.dtype), []).append(r)
        for (q, device, dtype), rs in groups.items():
            if q == rank:
                buf = torch.cat([values[r] for r in rs])
            else:
                buf = torch.empty(sum(r.size for r in rs), dtype=dtype, device=device)
            work = dist.broadcast(buf, src=q, group=distributed.group(), async_op=True)
            self.transfers.append((work, buf, () if q == rank else rs))

    def land(self) -> None:
        """Wait for every transfer and copy the owners' ranges into place."""
        transfers, self.transfers = self.transfers, []
        with torch.no_grad():
            for work, buf, rs in transfers:
                work.wait()
                at = 0
                for r in rs:
                    self.views[r.slot][r.start: r.stop].copy_(buf[at: at + r.size])
                    at += r.size
