"""The collectives of sharding: a reduce-scatter and an all-gather of slot ranges.

Both run on ``all_to_all_single`` (gloo and NCCL have it; gloo has no reduce-scatter)
with one flat buffer per (device, dtype). The reduce-scatter sums what the ranks send
for a range **in rank order** on its owner (``((g_0 + g_1) + g_2)``), so the default
reduction is deterministic for a world size and independent of the backend's
algorithm. With one process nothing is sent.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from . import distributed
from .shard_plan import Range, ShardPlan


def piece(g: torch.Tensor, r: Range, size: int) -> torch.Tensor:
    """Range ``r`` of a slot's gradient or value: cut from a whole tensor of the slot's
    ``size`` elements, or ``g`` itself (flat) when it already is the range."""
    flat = g.reshape(-1)
    return flat[r.start: r.stop] if flat.numel() == size else flat


def _groups(plan: ShardPlan, slots: Sequence[int], like: Sequence[torch.Tensor]) -> dict:
    """Slots by the (device, dtype) of ``like[slot]``, in slot order."""
    out: dict = {}
    for i in slots:
        out.setdefault((like[i].device, like[i].dtype), []).append(i)
    return out


def reduce_scatter(plan: ShardPlan, rank: int, grads: list, like: Sequence[torch.Tensor]) -> list:
    """Each trainable slot's range on its owner, summed over the ranks in rank order
    (aliases cut as their representative); ``None`` at slots this rank owns nothing of.
    ``grads``: this rank's per-slot sums (``None``: no item used the slot; sent as
    zeros, as data parallel sends every slot)."""
    world = plan.world
    if world == 1:  # nothing to send; a slot no item used keeps no gradient (no update, as torch)
        return [None if g is None or plan.range_of(i, 0) is None else piece(g, plan.range_of(i, 0), plan.sizes[i])
                for i, g in enumerate(grads)]
    slots = [i for i, c in enumerate(plan.slots_map) if c is not None]
    out: list = [None] * len(grads)
    for (device, dtype), members in _groups(plan, slots, like).items():
        parts, splits = [], []  # rank r's ranges of every member slot, rank after rank
        for r in range(world):
            sent = 0
            for i in members:
                own = plan.range_of(i, r)
                if own is None or own.size == 0:
                    continue
                g = grads[i]
                parts.append(torch.zeros(own.size, dtype=dtype, device=device) if g is None
                             else piece(g, own, plan.sizes[i]).to(dtype))
                sent += own.size
            splits.append(sent)
        mine = splits[rank]
        received = torch.empty(mine * world, dtype=dtype, device=device)
        send = torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=device)
        dist.all_to_all_single(received, send, [mine] * world, splits, group=distributed.group())
        chunks = received.split(mine) if mine else [received] * world
        summed = chunks[0] + chunks[1] if mine else received
        for c in chunks[2:] if mine else ():
            summed.add_(c)  # left to right over the ranks
        offset = 0
        for i in members:
            own = plan.range_of(i, rank)
            if own is not None and own.size:
                out[i] = summed[offset: offset + own.size]
                offset += own.size
            elif own is not None:
                out[i] = torch.zeros(0, dtype=dtype, device=device)
    return out


def all_gather_ranges(plan: ShardPlan, rank: int, like: Sequence[torch.Tensor], mine: dict) -> dict:
    """Every range's tensor on every rank: ``mine`` maps this rank's ranges to 1-D
    tensors of their slot's device and dtype (``like[slot]``'s); returns ``{Range:
    tensor}`` for every range of the plan. One all-to-all per (device, dtype), the
    groups taken from the plan, so every rank joins each (a rank's send: its ranges,
    concatenated and padded to the widest rank's, one buffer to every rank)."""
    if plan.world == 1:
        return dict(mine)
    groups: dict = {}
    for r in plan.ranges:
        t = like[r.slot]
        groups.setdefault((t.device, t.dtype), set()).add(r.slot)
    out: dict = {}
    for (device, dtype), slots in groups.items():
        per_rank = [[r for r in plan.ranges if r.slot in slots and r.rank == q] for q in range(plan.world)]
        width = max(sum(r.size for r in rs) for rs in per_rank)  # every rank's send padded to the widest
        local = torch.zeros(width, dtype=dtype, device=device)
        if per_rank[rank]:
            torch.cat([mine[r] for r in per_rank[rank]], out=local[: sum(r.size for r in per_rank[rank])])
        received = [torch.empty(width, dtype=dtype, device=device) for _ in range(plan.world)]
        dist.all_to_all(received, [local] * plan.world, group=distributed.group())  # one buffer sent to all
        for q, rs in enumerate(per_rank):
            offset = 0
            for r in rs:
                out[r] = received[q][offset: offset + r.size]
                offset += r.size
    return out


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
