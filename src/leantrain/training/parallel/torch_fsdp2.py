"""``engine="fsdp2"``: torch's ``fully_shard`` runs each update's forwards and backwards.

The user's module is never sharded. When the run starts, a working copy of it is made on
torch's meta device (its structure, hooks and ties; no values copied), ``fully_shard`` is applied to the copy's units (those ``sharding="parameters"``
gathers: every element of an ``nn.ModuleList`` by default, or the run's ``shard_units``)
and then to its root, so a tie lands in the root's group, and each rank's FSDP2 shard is
filled from the user's values (or from a resumed checkpoint's ranges). From then on:

* an update's items run through the copy: FSDP2's all-gathers before each unit, its
  reduce-scatter of the gradients after a rank's last item (``set_requires_gradient_sync``
  off for the others, torch's ``no_sync``), with the reduction a **sum** (gradient divide
  factor 1, sum-only collectives), then ``* (1/n)`` for the update's ``n`` items or a
  ``LossSum``'s summed count, as everywhere in leantrain;
* the plan (``fsdp2_plan``) is FSDP2's own cut: each slot's rows in ``torch.chunk``'s
  pieces, one flat element range per rank, which leantrain's sharded optimizer step,
  moving average and checkpoint folder take as they take their own: the optimizer's rules
  update the FSDP2 shard in place (no copy, nothing gathered), a checkpoint is
  leantrain's sharded folder, resumable under any engine and world size;
* the user's module keeps its Parameter objects, released between uses as under
  ``sharding="parameters"`` (``gathering.ParameterShards``, whose values *are* the FSDP2
  shards): the buffer pass, evaluation and the user's code between updates gather them
  from the shards, and the run's end writes the trained values back into them;
* every rank runs as many items as the rank with the most (3 items on 2 ranks: 2 each; 2
  items on 3 ranks: 1 each), a rank short of them the update's first item again as a
  stand-in, its gradient multiplied by zero and the generators kept, so every rank meets
  every all-gather and reduce-scatter.

Given up, as with ``engine="ddp"``: the bits of one process across world sizes (each rank
sums its items, the ranks' sums are added by the reduce-scatter). Kept at a fixed world
size: two runs give the same bits.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Optional

import torch
from torch import nn

from . import distributed
from .engines import FSDP2
from .sharding.gathering import ParameterShards, whole_units
from .sharding.plan import Range, ShardPlan
from .sharding.reduction import Sharded
from .sharding.resume import take, wanted_ranges
from .sharding.state import check_shardable, fresh, sharded, working
from .sharding.strategy import ShardedStrategy, ends_whole
from .sharding import step as shard_step
from .strategy import ParallelOptions
from ..runner.binding import MODEL_ERRORS, rng_preserved
from ..runner.runner import Runner
from ..update.mean import Mean, draws, drawn
from ...errors import CollectiveError, ConfigError, DataError, LeantrainError, slot_label
from ...samples import LossSum, add_losses, call_model, checked_loss, describe, loss_target


def fsdp2_plan(params, world: int) -> ShardPlan:
    """FSDP2's cut of the trained slots: a slot of ``rows`` rows (its first dimension)
    gives rank ``r`` the rows ``[r c, (r + 1) c)`` of ``c = ceil(rows / world)`` (fewer at
    the end, none past it: ``torch.chunk``), each one flat element range."""
    like, slots_map = working(params), params.canonical_slot_indices()
    ranges = []
    for i, c in enumerate(slots_map):
        if c != i:
            continue
        t = like[i]
        rows = t.shape[0]
        width = t.numel() // rows if rows else 0
        chunk = -(-rows // world)
        for r in range(world):
            lo, hi = min(r * chunk, rows) * width, min((r + 1) * chunk, rows) * width
            if hi > lo:
                ranges.append(Range(i, lo, hi, r))
        if t.numel() == 0:
            ranges.append(Range(i, 0, 0, 0))  # an empty slot keeps its history (its step count) on rank 0
    sizes = tuple(v.storage.host.numel() for v in params)
    return ShardPlan("parameters", world, sizes, tuple(slots_map), tuple(ranges), "fsdp2")


def check_fsdp2(op: str, runner: Runner, options: FSDP2, resumed: bool) -> None:
    """What ``fully_shard`` needs of the module, checked before anything changes."""
    if options.cpu_offload:
        raise ConfigError(f"{op}: FSDP2(cpu_offload=True) is not built yet: leantrain's gathers for evaluation and "
                          f"your code between updates read the shards on the run's device; use "
                          f"cpu_offload=False (the shards on the device), or engine='leantrain' with "
                          f"sharding='parameters'")
    for i, v in enumerate(runner.params):
        loc = runner.locations[i]
        if loc.is_parameter and v.storage.host.dim() == 0:
            raise ConfigError(f"{op}: engine='fsdp2': {slot_label(i, v.name)} is a 0-dim parameter, which torch's "
                              f"fully_shard does not shard; make it 1-D (shape (1,)), or use engine='leantrain'")
        if v.storage.mirror is not None:
            raise ConfigError(f"{op}: engine='fsdp2': {slot_label(i, v.name)} is computed through a copy of the "
                              f"module's Parameter (runner.to(device) keeps the module elsewhere): move the module "
                              f"itself (module.to(device)) before building the Runner")
    if runner.unfilled and not resumed:
        raise ConfigError(f"{op}: engine='fsdp2' shards a module that holds its values; this one was built on the "
                          f"meta device (fill it first, or use sharding='parameters' with init_weights=)")


class WorkCopy:
    """The module's working copy, sharded by ``fully_shard``; ``param_of[c]``: the FSDP2
    Parameter of representative slot ``c``."""

    def __init__(self, op: str, runner: Runner, options: FSDP2, unit_kinds) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        user = runner.module
        memo: dict = {}
        for p in user.parameters():
            if id(p) not in memo:
                memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for b in user.buffers():  # never the user's own: fully_shard moves a buffer on another device with
            # ``buffer.data = ...``; before each item the copy is pointed at the user's buffers (``follow``)
            memo[id(b)] = torch.empty_like(b, device="meta")
        try:
            work = copy.deepcopy(user, memo)
        except Exception as e:
            raise ConfigError(f"{op}: engine='fsdp2' shards a copy of the module (yours is kept as it is), and "
                              f"copy.deepcopy could not copy it ({type(e).__name__}: {str(e)[:120]}); use "
                              f"engine='ddp' or sharding='parameters'") from e
        self.pairs = list(zip(user.modules(), work.modules()))  # the same walk: a deep copy keeps the structure
        twin = {id(u): w for u, w in self.pairs}
        kinds = whole_units(user, unit_kinds)
        units = []
        for u in user.modules():
            unit = kinds.get(id(u))
            if unit is u and u is not user:
                units.append(twin[id(u)])
        device = runner.device
        group = distributed.group()  # the loop's own (its collective_timeout), else the default group
        mesh = DeviceMesh.from_group(group if group is not None else torch.distributed.group.WORLD, device.type)
        kw = dict(mesh=mesh, reshard_after_forward=options.reshard_after_forward,
                  mp_policy=MixedPrecisionPolicy(param_dtype=options.param_dtype, reduce_dtype=options.reduce_dtype))
        for unit in reversed(units):  # inner units first (whole_units gives the outermost only)
            fully_shard(unit, **kw)
        fully_shard(work, **kw)  # the root last: ties and the remaining parameters land here
        for m in work.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)  # a sum: leantrain divides by the items
                m.set_force_sum_reduction_for_comms(True)  # (gloo has no PREMUL_SUM)
        work.to_empty(device=device)
        self.module = work
        self.param_of: dict = {}  # representative slot -> the copy's FSDP2 Parameter
        self.frozen: list = []  # (the copy's Parameter, the user's tensor) of slots not trained
        reps, like = runner.params.canonical_slot_indices(), working(runner.params)
        seen = set()
        for i, loc in enumerate(runner.locations):
            if not loc.is_parameter:
                continue
            p = twin[id(loc.owner)]._parameters[loc.attr]
            if reps[i] == i:
                self.param_of[i] = p
            if id(p) in seen:
                continue
            seen.add(id(p))
            if reps[i] is None:
                self.frozen.append((p, like[i]))

    def adopt(self, shards: ParameterShards, rank: int) -> None:
        """Each FSDP2 shard filled with this rank's values (a frozen slot's from the user's
        whole tensor), then the shards become the values the sharded step updates."""
        with torch.no_grad():
            for p, full in self.frozen:
                local = p.to_local().view(-1)
                rows = full.shape[0]
                start = min(rank * -(-rows // shards.world), rows) * (full.numel() // rows if rows else 0)
                local.copy_(full.reshape(-1)[start: start + local.numel()])
            for r, v in list(shards.values.items()):
                local = self.param_of[r.slot].to_local().view(-1)
                local.copy_(v)
                shards.values[r] = local  # the optimizer updates FSDP2's shard itself

    def follow(self) -> None:
        """The copy's buffers are the user's current ones (the update's scratch copies), and
        each of its modules in the mode the user's is in (train, or eval where you set it)."""
        for u, w in self.pairs:
            w.training = u.training
            for name, b in u._buffers.items():
                w._buffers[name] = b

    def gradients(self, count: int) -> list:
        """Per slot: this rank's range of a representative's summed gradient (flat), taken
        from its FSDP2 Parameter (whose ``.grad`` is cleared), or ``None``."""
        out: list = [None] * count
        for c, p in self.param_of.items():
            g = p.grad
            if g is not None:
                out[c] = g.to_local().reshape(-1)
                p.grad = None
        return out

    def sync(self, on: bool) -> None:
        self.module.set_requires_gradient_sync(on)


class TorchFSDP2(Sharded):
    """The update's seam under ``engine="fsdp2"``: items through FSDP2's copy, the
    optimizer on this rank's FSDP2 shards (``Sharded.apply`` with the shards as values)."""

    def __init__(self, options: FSDP2, local: bool = False) -> None:
        super().__init__(False, local)
        self.options = options
        self.name = "torch fully_shard (FSDP2)"
        self.work: Optional[WorkCopy] = None

    def mean(self, runner: Runner, leaves, scratch, batch, o, want_loss: bool, states: Optional[list]) -> Mean:
        n = self.count(runner, len(batch))
        mine, own = self.shares(batch, states)
        work = self.work
        world = self.plan.world
        # every rank runs as many forwards and backwards as the rank with the most items (FSDP2 gathers
        # before each unit's forward and reduce-scatters after the last backward): the others pad with
        # stand-ins, the first item again, its gradient multiplied by zero and the generators kept
        rounds = -(-len(batch) // world)
        items = list(mine) + [batch[0]] * (rounds - len(mine))
        trains = bool(work.param_of) and any(p.requires_grad for p in work.param_of.values())
        loss = None
        try:
            for j, sample in enumerate(items):
                if j:
                    scratch.reset()
                stand_in = j >= len(mine)
                work.follow()
                work.sync(j == len(items) - 1)  # the reduce-scatter after the rank's last item only
                with contextlib.ExitStack() as stack:
                    if stand_in:  # the forward only meets the collectives: nothing of it is kept
                        stack.enter_context(rng_preserved(runner.device))
                    else:
                        draws(runner, own, j)
                    if not trains:
                        stack.enter_context(torch.no_grad())
                    item_loss = self.item(runner, sample, j, stand_in, trains)
                if not stand_in:
                    drawn(runner, own, j)
                    loss = item_loss if loss is None else add_losses(loss, item_loss)
        finally:
            work.sync(True)
        grads = work.gradients(len(leaves))
        loss = shard_step.reduced_loss(runner, loss, want_loss, self.plan.world)
        return Mean.of_sums(loss, grads, n, o.scaler is None)

    def item(self, runner: Runner, sample, j: int, stand_in: bool, trains: bool):
        """One item's forward through the copy and (``trains``) its backward."""
        s = runner.inputs(sample)
        try:
            with runner.autocast():
                value = runner.loss_fn(call_model(self.work.module, s), loss_target(s))
        except MODEL_ERRORS as e:
            if isinstance(e, LeantrainError):
                raise
            if distributed.from_a_collective(e):
                raise CollectiveError(f"FSDP2's all-gather: {str(e).splitlines()[0]}") from e
            raise DataError(f"item {j}: Runner.loss: the model or loss rejected the sample ({describe(s)}): "
                            f"{str(e).splitlines()[0]}") from e
        value = checked_loss("Runner.loss", value)
        total, count = (value.total, value.count) if isinstance(value, LossSum) else (value, None)
        if trains:
            if not total.requires_grad:
                raise ConfigError("Runner.loss: the loss must be a floating-point tensor autograd built (was it "
                                  "detached, or computed under torch.no_grad()?)")
            scale = runner.loop.loss_scale
            out = total * 0.0 if stand_in else total if scale is None else total * scale[0]
            try:
                out.backward()
            except RuntimeError as e:
                if distributed.from_a_collective(e):
                    raise CollectiveError(f"FSDP2's gradient reduce-scatter: {str(e).splitlines()[0]}") from e
                raise
        return total.detach() if count is None else LossSum(total.detach(), count)


class FSDP2Strategy(ShardedStrategy):
    """A loop under ``torch.distributed`` with ``engine="fsdp2"``: parameter sharding's
    start, decisions, moving average and checkpoint folder over FSDP2's plan; FSDP2's copy
    for the forwards and backwards. The copy goes when the run ends."""

    def __init__(self, settings: ParallelOptions, local: bool = False) -> None:
        reduction = TorchFSDP2(settings.engine, local)
        super(ShardedStrategy, self).__init__(settings, reduction.local, reduction)
        self.name = reduction.name
        self.ranged = {}

    def plan(self, runner: Runner) -> ShardPlan:
        return fsdp2_plan(runner.params, distributed.rank_world()[1])

    def start(self, op: str, runner: Runner, opt, native: bool, whole=None):
        r = self.reduction
        if r.local:
            raise ConfigError(f"{op}: engine='fsdp2' needs every rank to read the same batches (FSDP2's gathers are "
                              f"collectives, run once per item on every rank); give the loop the whole data, or use "
                              f"engine='ddp'")
        ranged = self.ranged
        check_fsdp2(op, runner, r.options, bool(ranged))
        check_shardable(op, runner)
        plan = self.plan(runner)
        rank = r.rank
        state = sharded(whole, plan, rank, runner.params) if whole is not None else \
            fresh(opt, runner.params, plan, rank, native)
        work = WorkCopy(op, runner, r.options, self.settings.shard_units)
        filling = (lambda shards: take(shards, ranged, runner.params)) if ranged else None  # noqa: E731
        self.ends_whole = ends_whole(self.settings, runner)
        r.shards = ParameterShards(op, runner, plan, rank, filling, self.settings.shard_units)
        work.adopt(r.shards, rank)
        runner.unfilled, self.ranged = {}, {}
        r.work, r.plan, r.guard_next = work, plan, True
        return state

    def resume_ranges(self, runner: Runner):
        return wanted_ranges(self.settings, runner, self.plan(runner))  # this rank's FSDP2 ranges only

    def close(self, runner: Runner, failed: bool) -> None:
        super().close(runner, failed)  # the module whole again, from the FSDP2 shards
        self.reduction.work = None  # the copy and its shards go
