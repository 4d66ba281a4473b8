"""The collectives of sharding: the all-gather of slot ranges and small agreements.

The reduce-scatter is ``overlap.ShardReducer``'s (point to point, each range summed over
the ranks **in rank order** on its owner, ``((g_0 + g_1) + g_2)``, so the default reduction
is deterministic for a world size and independent of the backend's algorithm);
``own_ranges`` is its one-process form, where nothing is sent.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from .. import distributed
from .plan import Range, ShardPlan


def piece(g: torch.Tensor, r: Range, size: int) -> torch.Tensor:
    """Range ``r`` of a slot's gradient or value: cut from a whole tensor of the slot's
    ``size`` elements, or ``g`` itself (flat) when it already is the range."""
    flat = g.reshape(-1)
    return flat[r.start: r.stop] if flat.numel() == size else flat


def own_ranges(plan: ShardPlan, grads: list) -> list:
    """One process's reduce-scatter: each trainable slot's range (the whole slot, flat),
    ``None`` where no item used the slot (no gradient, no update, as torch)."""
    return [None if g is None or plan.range_of(i, 0) is None else piece(g, plan.range_of(i, 0), plan.sizes[i])
            for i, g in enumerate(grads)]


GATHER_BYTES = 25 * 2**20  # an all-gather moves about this much at once (DDP's bucket size)


def _chunks(ranges: list, limit: int) -> Iterator[list]:
    """``ranges`` (plan order) in runs of at most ``limit`` elements (a larger range alone)."""
    chunk, size = [], 0
    for r in ranges:
        if chunk and size + r.size > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append(r)
        size += r.size
    if chunk:
        yield chunk


def all_gather_ranges(plan: ShardPlan, rank: int, like: Sequence[torch.Tensor], mine: dict
                      ) -> Iterator[tuple[Range, torch.Tensor]]:
    """Every range's tensor on every rank, as ``(Range, tensor)`` pairs to copy from at
    once: ``mine`` maps this rank's ranges to 1-D tensors of their slot's device and
    dtype (``like[slot]``'s). The ranges go per (device, dtype), in runs of about
    ``GATHER_BYTES`` taken from the plan, so the buffers never hold more than one run;
    in a run each rank broadcasts its ranges, concatenated, to the others (every rank
    knows every size from the plan). One broadcast per rank and run: on gloo that
    measured 2.5x faster than ``all_gather`` and 4x faster than ``all_to_all`` for the
    same bytes (25 and 128 MiB, 2 processes). A tensor given is valid until the next
    pair is asked for."""
    if plan.world == 1:
        yield from mine.items()
        return
    groups: dict = {}
    for r in plan.ranges:
        t = like[r.slot]
        groups.setdefault((t.device, t.dtype), []).append(r)
    for (device, dtype), ranges in groups.items():
        limit = max(1, GATHER_BYTES // torch.empty((), dtype=dtype).element_size())
        for chunk in _chunks(ranges, limit):
            for q in range(plan.world):
                rs = [r for r in chunk if r.rank == q]
                size = sum(r.size for r in rs)
                if not size:
                    continue
                if q == rank:
                    buf = torch.cat([mine[r] for r in rs])
                else:
                    buf = torch.empty(size, dtype=dtype, device=device)
                dist.broadcast(buf, src=q, group=distributed.group())
                if q == rank:
                    yield from ((r, mine[r]) for r in rs)  # its own, as given
                    continue
                offset = 0
                for r in rs:
                    yield r, buf[offset: offset + r.size]
                    offset += r.size


def gather_small(values: torch.Tensor, world: int) -> list[torch.Tensor]:
    """A small tensor of one shape from every rank, in rank order."""
    if world == 1:
        return [values]
    out = [torch.empty_like(values) for _ in range(world)]
    dist.all_gather(out, values.contiguous(), group=distributed.group())
    return out


def flag_any(found: torch.Tensor, world: int) -> torch.Tensor:
    """The non-finite flag set on every rank where it is set on one (no host read)."""
    if world > 1:
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=distributed.group())
    return found


def values(plan: ShardPlan, rank: int, like: Sequence[torch.Tensor], owned: Optional[list] = None) -> dict:
    """This rank's ranges of the working tensors ``like`` (views, flat)."""
    rs = plan.owned(rank) if owned is None else owned
    return {r: like[r.slot].view(-1)[r.start: r.stop] for r in rs}
