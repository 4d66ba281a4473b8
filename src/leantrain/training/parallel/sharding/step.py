"""One update under sharding: reduce-scatter, update the owned ranges, all-gather.

The ranks' gradient sums are reduce-scattered (``shard_comm``: each range summed on its
owner in rank order); a rank keeps its ranges' optimizer state only.
``sharding="optimizer"`` (ZeRO stage 1) all-gathers the reduced gradient back when
clipping by norm asks for it, so the norm is ``clip_grad_norm_``'s, bit for bit (the
update itself reads only the ranges, so without clipping nothing is gathered back).
``sharding="gradients"`` (stage 2) never holds more than its ranges of the reduced
gradient; clipping by norm then takes the norm of **64-element blocks**: each
block's sum of squares in float64, all blocks summed in slot and block order, so the
norm has the same bits on every world size (it is not ``clip_grad_norm_``'s bits).

The update runs the optimizer's own rules and fused kernels on the owned ranges (flat
views of the parameters, cut at multiples of 64 elements, so each element gets the
bits the whole tensor's update gives it), then every rank's ranges are all-gathered
into every rank's parameters. With ``exact_reduction`` the gradients come from the
item-order fold (``data_parallel.exact_gradients``): the one-process bits on any world
size. Skipped steps (``nonfinite="skip"``) are undone on the device, as unsharded.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ....optim import OptState, Optimizer
from ....optim.optimizer import advanced, group_rate
from ....optim.rules import rule_for
from .. import data_parallel as dp
from . import comm
from ....samples import LossSum
from ..overlap import step_buckets
from .overlap import ShardReducer
from .plan import ALIGN, ShardPlan
from .state import slot_settings, working


def keeps_ranges(plan: ShardPlan, clip_grad_norm: Optional[float]) -> bool:
    """Whether a step holds only this rank's ranges of the reduced gradient: always under
    ``"gradients"`` and ``"parameters"``; under ``"optimizer"`` too unless clipping by norm needs the whole
    gradient (for ``clip_grad_norm_``'s bits) — the update itself reads only the ranges."""
    return plan.mode != "optimizer" or clip_grad_norm is None


def reduced(runner, leaves, plan: ShardPlan, rank: int, grads: list, whole: bool = False) -> list:
    """The ranks' per-slot sums (``grads``, of ``leaves``) reduced: this rank's ranges, or
    (``whole``) whole slots on every rank (the ranges all-gathered back)."""
    if plan.world == 1:
        ranges = comm.own_ranges(plan, grads)
    else:  # the buckets of the overlapped reduce-scatter, sent one after another now
        ranges = ShardReducer(plan, rank, step_buckets(runner, leaves)[0], None).finish(grads)
    return whole_of(plan, rank, runner.params, ranges) if whole else ranges


def whole_of(plan: ShardPlan, rank: int, params, ranges: list) -> list:
    """Reduced ranges all-gathered into whole per-slot gradients on every rank."""
    like = working(params)
    if plan.world == 1:  # the ranges are the whole slots already (None: no gradient)
        return [None if g is None else g.view(like[j].shape) for j, g in enumerate(ranges)]
    every = plan.with_aliases()  # one all-gather per (device, dtype) for every slot's shares
    mine = {r: ranges[r.slot] for r in every.ranges if r.rank == rank}
    out: list = [None] * len(ranges)
    for j, c in enumerate(plan.slots_map):
        if c is not None:
            out[j] = torch.empty(like[j].numel(), dtype=like[j].dtype, device=like[j].device)
    for r, t in comm.all_gather_ranges(every, rank, like, mine):
        out[r.slot][r.start: r.stop] = t
    return [None if g is None else g.view(like[j].shape) for j, g in enumerate(out)]


def reduced_loss(runner, loss, want_loss: bool, world: int):
    """The loss over every rank's items, summed in rank order: a ``LossSum``'s total and
    count always (the count divides the gradients), a scalar loss only if asked for."""
    if world == 1:
        return torch.zeros((), device=runner.device) if loss is None else loss
    sums = dp.sums_losses(runner, loss)
    if not (sums or want_loss):
        return torch.zeros((), device=runner.device)  # not asked for: never read
    pair = torch.zeros(2, dtype=torch.float64, device=runner.device)
    if loss is not None:
        pair[0] = (loss.total if sums else loss).detach().to(torch.float64)
        if sums:
            pair[1] = torch.as_tensor(loss.count, device=pair.device).to(torch.float64)
    rows = comm.gather_small(pair, world)
    total = rows[0] + rows[1]
    for row in rows[2:]:
        total = total + row
    dtype = torch.float32 if loss is None else (loss.total if sums else loss).dtype
    return LossSum(total[0].to(dtype), total[1]) if sums else total[0]


def canonical_ranges(plan: ShardPlan, rank: int, grads: list) -> dict:
    """Per owned range, its slot's canonical gradient there: the representative's share,
    then each alias's added left to right (``canonical_gradients``' order); ``None``
    where no slot of the storage has a gradient."""
    out = {}
    for r in plan.owned(rank):
        g = None
        for j, c in enumerate(plan.slots_map):
            if c == r.slot and grads[j] is not None:
                part = comm.piece(grads[j], r, plan.sizes[r.slot])
                g = part if g is None else g + part
        out[r] = g
    return out


def clip_ranges(plan: ShardPlan, rank: int, sums: dict, max_norm: Optional[float],
                max_value: Optional[float], like=None) -> Optional[torch.Tensor]:
    """Clip the owned canonical ranges in place: by value elementwise; by norm with the
    block norm (see the module's doc), the same on every rank and world size. Returns the
    norm before clipping (by norm), else ``None``."""
    present = [g for g in sums.values() if g is not None and g.numel()]
    if max_value is not None:
        for g in present:
            g.clamp_(-max_value, max_value)
        return None
    if max_norm is None:
        return None
    if plan.by == "slot":
        return _slot_norm_and_scale(plan, sums, present, max_norm, like)
    blocks = []
    for r, g in sums.items():
        n = -(-r.size // ALIGN)
        sq = torch.zeros(n * ALIGN, dtype=torch.float64, device=g.device if g is not None else "cpu")
        if g is not None and r.size:
            sq[: r.size] = g.detach().to(torch.float64).square()
        blocks.append((r, sq.view(n, ALIGN).sum(1) if n else sq[:0]))
    return _norm_and_scale(plan, rank, blocks, present, max_norm)


def _slot_norm_and_scale(plan: ShardPlan, sums: dict, present: list, max_norm: float, like) -> torch.Tensor:
    """Whole slots per rank: each owner takes its slots' norms as ``clip_grad_norm_``
    does (``_foreach_norm``); one sum over the ranks gathers them (each norm has one
    owner and zeros elsewhere, so the sum is exact); then the norm of the norms in
    ``clip_grad_norm_``'s order (grouped by device and dtype, in slot order): its bits.
    Nothing is read back: under data parallel every slot has a gradient (a slot no item
    used arrives as zeros), in one process this rank sees which have one."""
    slots = [r.slot for r in plan.ranges]
    at = {s: k for k, s in enumerate(slots)}
    device = like[slots[0]].device if slots else torch.device("cpu")
    local = torch.zeros(len(slots), dtype=torch.float64, device=device)
    for r, g in sums.items():
        if g is not None:
            local[at[r.slot]] = torch._foreach_norm([g], 2.0)[0].double()
    if plan.world > 1:
        dist.all_reduce(local, group=comm.distributed.group())
        kept = set(slots)
    else:
        kept = {r.slot for r, g in sums.items() if g is not None}
    groups: dict = {}
    for s in slots:  # the gradients clip_grad_norm_ would see, by (device, dtype) in order of first appearance
        if s in kept:
            groups.setdefault((like[s].device, like[s].dtype), []).append(s)
    norms = [local[at[s]].to(dtype) for (_, dtype), members in groups.items() for s in members]
    norm = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2.0)
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in present:
        g.mul_(factor.to(g.device))
    return norm


def _norm_and_scale(plan: ShardPlan, rank: int, blocks: list, present: list, max_norm: float) -> torch.Tensor:
    """Gather every rank's block sums, add them all in slot and block order, scale."""
    counts = [sum(-(-r.size // ALIGN) for r in plan.owned(q)) for q in range(plan.world)]
    width = max(counts) if counts else 0
    device = blocks[0][1].device if blocks else torch.device("cpu")
    local = torch.zeros(width, dtype=torch.float64, device=device)
    if blocks:
        mine = torch.cat([b for _, b in blocks])
        local[: mine.numel()] = mine
    gathered = comm.gather_small(local, plan.world)
    position = {q: 0 for q in range(plan.world)}
    rows = {}  # every range's block sums, from its owner's row
    for q in range(plan.world):
        for r in plan.owned(q):
            k = -(-r.size // ALIGN)
            rows[r] = gathered[q][position[q]: position[q] + k]
            position[q] += k
    ordered = [rows[r] for r in plan.ranges]  # slot and block order
    norm = torch.cat(ordered).sum().sqrt() if ordered else torch.zeros((), dtype=torch.float64)
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in present:
        g.mul_(factor.to(g.dtype))
    return norm


def apply(runner, opt: Optimizer, state: OptState, plan: ShardPlan, rank: int, grads: list,
          found: Optional[torch.Tensor], presummed: bool = False,
          sums: Optional[dict] = None, values: Optional[dict] = None) -> OptState:
    """Update this rank's ranges with the optimizer's rule, then all-gather the values.
    ``presummed``: ``grads`` already holds canonical gradients (clipping made them);
    ``sums``: the owned canonical ranges, if computed already (block clipping);
    ``values``: parameter sharding's owned ranges, updated where they are and not gathered."""
    params, hyper = runner.params, opt.hyper
    like, settings = working(params), slot_settings(opt, params)
    if sums is None:
        sums = canonical_ranges(plan, rank, grads) if not presummed else {
            r: None if grads[r.slot] is None else comm.piece(grads[r.slot], r, plan.sizes[r.slot])
            for r in plan.owned(rank)}
    rule = rule_for(hyper)
    records = list(state.slots)
    views = comm.values(plan, rank, like) if values is None else values
    targets = [] if found is None else [t for r in views for t in [views[r]] + list(records[r.slot].tensors().values())]
    saved = [t.detach().clone() for t in targets]  # skip mode: what a skipped step puts back
    groups: dict = {}
    for r, g in sums.items():
        if g is None and hyper.numerics != "torchlean":
            continue  # no gradient, no update (torch's rule)
        st = settings[r.slot]
        groups.setdefault((id(st.hyper), st.scale, st.group, like[r.slot].device, like[r.slot].dtype),
                          (st, []))[1].append(r)
    with torch.no_grad():
        for st, rs in groups.values():
            lr, h = group_rate(state, st), state.cycled(st.hyper, st.group)
            ws = [views[r] for r in rs]
            gs = [torch.zeros_like(views[r]) if sums[r] is None else sums[r].reshape(-1) for r in rs]
            recs = [records[r.slot] for r in rs]
            if h.numerics == "torchlean":
                news = [rule.reference(h, lr, s, w, g) for s, w, g in zip(recs, ws, gs)]
            else:
                news = rule.update_many(h, lr, recs, ws, gs, uniform=True)
            for r, n in zip(rs, news):
                records[r.slot] = n
        if found is not None:
            keep = found[0] == 0
            for t, old in zip(targets, saved):
                torch.where(keep, t, old, out=t)
        for r, t in () if values is not None else comm.all_gather_ranges(plan, rank, like,
                                                                        {r: views[r] for r in plan.owned(rank)}):
            if r.rank != rank:
                like[r.slot].view(-1)[r.start: r.stop].copy_(t)
    for v in params.storages():
        if v.mirror is not None and v.working() is v.mirror:
            v.host_current = False  # the mirror was written
    return advanced(state, records)
