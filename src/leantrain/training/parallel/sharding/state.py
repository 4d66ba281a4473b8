"""Optimizer state under sharding: each rank keeps the records of its ranges only.

A sharded ``OptState`` has the shape of any other: one entry per slot, a record at a
representative this rank owns a range of (its tensors flat, the range's length), and
``None`` elsewhere. ``fresh`` makes one without ever allocating the whole state;
``sharded`` cuts a whole state (a resumed checkpoint's, which ``io/sharded.py`` puts
together from any number of ranks' files) by a plan.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from ....errors import ConfigError
from ....io.sharded import read_in_part
from ....optim import OptState, Optimizer
from ....optim.layout import GENERIC, NATIVE
from ....optim.per_slot import plain
from ....optim.rules import rule_for
from .. import distributed
from .plan import ShardPlan, plan_for


def working(params) -> list[torch.Tensor]:
    """Each slot's working tensor (the mirror where there is one, else the host)."""
    return [v.storage.working() for v in params]


def check_shardable(op: str, runner) -> None:
    """What sharding needs of a model, checked before a loop changes anything: every
    trainable representative a dense, contiguous tensor (its flat view is its memory
    order, which the kernels pair elements by), and no module making sparse gradients."""
    params = runner.params
    like = working(params)
    for i, c in enumerate(params.canonical_slot_indices()):
        if c == i and not (like[i].layout == torch.strided and like[i].is_contiguous()):
            raise ConfigError(f"{op}: sharding cuts slot {i} ({params[i].name}) along its memory, but that tensor is "
                              f"not contiguous (strides {like[i].stride()}); make it contiguous, or train unsharded")
    for name, m in runner.module.named_modules():
        if getattr(m, "sparse", False) is True:  # nn.Embedding(sparse=True), EmbeddingBag
            raise ConfigError(f"{op}: module {name!r} ({type(m).__name__}) makes sparse gradients, which sharding "
                              f"does not cut; use sparse=False, or train unsharded")


def slot_settings(opt: Optimizer, params):
    settings, _ = opt.settings("sharding", params)
    return settings if settings is not None else plain(opt.hyper, params)


def fresh(opt: Optimizer, params, plan: ShardPlan, rank: int, native: bool) -> OptState:
    """A new history holding only this rank's ranges (zeros, as ``opt.init``'s)."""
    like, settings = working(params), slot_settings(opt, params)
    records: list = [None] * len(params)
    for r in plan.owned(rank):
        records[r.slot] = rule_for(opt.hyper).init(settings[r.slot][0], like[r.slot].view(-1)[r.start: r.stop])
    asked, bases = opt.settings("sharding", params)[1], opt.group_lrs
    return OptState(opt.hyper, opt.hyper.lr, NATIVE if native else GENERIC, tuple(records), 0, asked, lrs=bases,
                    bases=bases)


def sharded(state: OptState, plan: ShardPlan, rank: int, params) -> OptState:
    """A whole state's records cut to this rank's ranges, copied to the device of each
    slot's working tensor (a resumed state is read into host memory, so the device never
    holds more than this rank's ranges)."""
    like = working(params)
    records: list = [None] * len(state.slots)
    for r in plan.owned(rank):
        rec = state.slots[r.slot]
        if rec is not None:
            device = like[r.slot].device
            records[r.slot] = replace(rec, **{k: own_range(t, r, device) for k, t in rec.tensors().items()})
    return replace(state, slots=tuple(records))


def own_range(t: torch.Tensor, r, device) -> torch.Tensor:
    """Range ``r`` of ``t`` (flat) as memory of its own on ``device``: a copy, or, of a
    tensor a resume read in part (only this rank's ranges backed), the slice itself."""
    v = t.reshape(-1)[r.start: r.stop]
    return v if read_in_part(t) and v.device == torch.device(device) else v.to(device, copy=True)


def loop_start(op: str, settings, runner, opt: Optimizer, native: bool,
               whole: Optional[OptState] = None) -> tuple[Optional[ShardPlan], OptState]:
    """A loop's plan (``None`` unsharded) and its history: fresh, or ``whole`` (a
    resumed checkpoint's state) cut to this rank's ranges (``settings``: the run's ``ParallelOptions``)."""
    params = runner.params
    if settings.sharding is None:
        return None, whole if whole is not None else opt.init(params, native=native)
    rank, world = distributed.rank_world()
    plan = plan_for(settings.sharding, params, world, settings.shard_by)
    check_shardable(op, runner)  # as the loop's start checked it (the module may have changed since)
    return plan, sharded(whole, plan, rank, params) if whole is not None else fresh(opt, params, plan, rank, native)


def check_plan(op: str, plan: ShardPlan, slots_map: list) -> None:
    """The trainable slots must stay those the plan was cut for."""
    if tuple(slots_map) != plan.slots_map:
        raise ConfigError(f"{op}: the trainable slots or ties changed during a sharded run (a requires_grad "
                          f"turned on or off, or a re-tie); sharding cuts the slots of the run's start: save a "
                          f"checkpoint and resume to re-cut them")
