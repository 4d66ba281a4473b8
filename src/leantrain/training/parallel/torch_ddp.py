"""``engine="ddp"``: torch's ``DistributedDataParallel`` reduces each update's gradients.

Each rank differentiates its share of the update's items (item ``j`` on rank ``j mod
world``, or its own items with rank-local data) with ``loss.backward()`` through a DDP
wrapper, under ``no_sync`` for every item but its last: the items' gradients accumulate
in ``.grad``, and the last backward runs DDP's bucketed all-reduce. The wrapper holds the
trained Parameters themselves (the user's objects, ``Holder``), never the user's module,
so the module is never changed and DDP's hooks go when the run ends.

What leantrain's contract needs beyond DDP's own:

* the mean: DDP averages over ranks; the comm hook here sums instead (``summed``), so
  the update's gradient is ``(sum over ranks of each rank's sum) * (1/n)`` for the ``n``
  items of the update, and a ``LossSum``'s summed count divides it (token weighting);
* a rank with no item (more ranks than items) still meets every rank's all-reduce: it
  runs the first item's forward and backward with the generators and buffers kept and
  sends zeros in DDP's buckets (``phantom``), so uneven updates never hang;
* ties: the tied Parameter is used at every occurrence (one ``.grad``, autograd's sum),
  frozen slots are not the wrapper's, buffers are advanced by leantrain's buffer pass on
  every rank (the wrapper has none to broadcast);
* the generators: each item starts where it starts in one process, as leantrain's data
  parallel does (``update/mean.draws``).

Not kept: the one-process bits across world sizes (each rank sums its items first).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from . import distributed
from .data_parallel import DataParallel, DataParallelStrategy, sums_losses
from .engines import DDP
from .strategy import ParallelOptions
from ..runner.backward import own_gradients
from ..runner.binding import rng_preserved
from ..runner.runner import Runner
from ..update.mean import Mean, draws, drawn
from ...errors import CollectiveError, ConfigError, DataError, slot_label
from ...samples import LossSum, add_losses

_INIT_SYNC = "init_sync" in inspect.signature(DistributedDataParallel.__init__).parameters


class Holder(nn.Module):
    """The run's trained Parameters as one module for DDP (the user's objects, registered
    here too; the user's module is not touched). Its forward runs the call it is given:
    one item's loss, computed by the runner over the user's module."""

    def __init__(self, params: list) -> None:
        super().__init__()
        for k, p in enumerate(params):
            self.register_parameter(f"slot{k}", p)
        self.count = None  # the item's LossSum count (the forward returns the tensor DDP hooks)

    def forward(self, call):
        loss = call()
        if isinstance(loss, LossSum):
            self.count = loss.count
            return loss.total
        self.count = None
        return loss


class HookState:
    """What the comm hook reads and says: the group, whether this rank sends zeros
    (``phantom``), whether an all-reduce failed (``failed``: a peer lost, not the model)."""

    def __init__(self, group) -> None:
        self.group, self.phantom, self.failed = group, False, False


def summed(state: HookState, bucket):  # (no annotations: DDP checks them as objects)
    """DDP's comm hook: the bucket summed over the ranks (torch's default averages); a
    rank without items sends zeros."""
    buf = bucket.buffer()
    if state.phantom:
        buf.zero_()

    def done(fut):
        try:
            return fut.value()[0]
        except BaseException:
            state.failed = True  # the backward's error is the collective's
            raise

    try:
        return dist.all_reduce(buf, group=state.group, async_op=True).get_future().then(done)
    except BaseException:
        state.failed = True
        raise


class TorchDDP(DataParallel):
    """Data parallel whose gradient reduction is torch's ``DistributedDataParallel``."""

    probes = True  # every rank runs every item's buffer pass: every rank's buffers alike (none broadcast)

    def __init__(self, options: DDP, local: bool = False) -> None:
        super().__init__(False, local)
        self.options = options
        self.name = "torch DistributedDataParallel" + (", rank-local data" if local else "")
        self.key: Optional[tuple] = None  # the wrapped Parameters (by id)
        self.ddp: Optional[DistributedDataParallel] = None
        self.state: Optional[HookState] = None

    def wrapped(self, runner: Runner, wrt: tuple) -> DistributedDataParallel:
        """The DDP wrapper of ``wrt`` (made at the first update, and again if the trained
        set changed: every rank changes it in the same user code)."""
        key = tuple(id(t) for t in wrt)
        if key == self.key:
            return self.ddp
        own = {id(t) for t in runner.view.originals}
        for t in wrt:
            if not isinstance(t, nn.Parameter) or id(t) not in own:
                k = next(i for i, leaf in enumerate(runner.bound.leaves) if leaf is t)
                raise ConfigError(
                    f"engine='ddp': {slot_label(k, runner.params[k].name)} is computed through a copy of the module's "
                    f"Parameter (runner.to(device) keeps the module elsewhere): DDP reduces the module's own "
                    f"Parameters, so move the module itself (module.to(device)) before building the Runner")
        self.release()
        o = self.options
        extra = {"init_sync": False} if _INIT_SYNC else {}  # leantrain made the replicas alike already
        if o.bucket_cap_mb is not None:
            extra["bucket_cap_mb"] = o.bucket_cap_mb
        group = distributed.group()
        ddp = DistributedDataParallel(Holder(list(wrt)), device_ids=None, process_group=group,
                                      find_unused_parameters=o.find_unused_parameters,
                                      gradient_as_bucket_view=o.gradient_as_bucket_view, **extra)
        self.state = HookState(group)
        ddp.register_comm_hook(self.state, summed)
        self.ddp, self.key = ddp, key
        return ddp

    def release(self) -> None:
        """Drop the wrapper, its reducer's hooks taken off the user's Parameters now (not
        when the collector gets to it)."""
        remove = getattr(getattr(self.ddp, "reducer", None), "_remove_autograd_hooks", None)
        if remove is not None:
            remove()
        self.ddp, self.key, self.state = None, None, None

    def mean(self, runner: Runner, leaves, scratch, batch, o, want_loss: bool, states: Optional[list]) -> Mean:
        n = self.count(runner, len(batch))
        mine, own = self.shares(batch, states)
        bound = runner.bound
        wrt = bound.wrt
        if not wrt:  # every slot frozen: nothing to reduce
            return Mean.of_sums(*self.losses_only(runner, mine, scratch, own), n)
        ddp = self.wrapped(runner, wrt)
        phantom = not mine
        items = list(mine) if mine else list(batch[:1])  # a rank without items runs the first, for the collectives
        if not items:  # rank-local data gives every rank items (rank_data.rank_local refuses a tail without)
            rank, world = distributed.rank_world()
            raise DataError(f"engine='ddp': rank {rank} of {world} has no item in this update, and DDP's "
                            f"all-reduce needs a backward on every rank; use engine='leantrain' (its ranks send zeros)")
        saved = [t.grad for t in wrt]
        loss = None
        try:
            for t in wrt:
                t.grad = None
            for j, sample in enumerate(items):
                if j:
                    scratch.reset()
                last = j == len(items) - 1
                self.state.phantom = phantom
                with contextlib.ExitStack() as stack:
                    if not last:
                        stack.enter_context(ddp.no_sync())
                    if phantom:  # the forward only meets the collectives: nothing of it is kept
                        stack.enter_context(rng_preserved(runner.device))
                    else:
                        draws(runner, own, j)
                    item_loss = self.item(runner, ddp, sample, j)
                if not phantom:
                    drawn(runner, own, j)
                    loss = item_loss if loss is None else add_losses(loss, item_loss)
            raw = tuple(t.grad for t in wrt)
        finally:
            for t, g in zip(wrt, saved):
                t.grad = g
            self.state.phantom = False
        grads = iter(own_gradients(raw, wrt, bound.strides))
        pack = [None if t is None else next(grads) for t in leaves]
        return Mean.of_sums(self.reduced_loss(runner, loss, want_loss), pack, n, o.scaler is None)

    def item(self, runner: Runner, ddp, sample, j: int):
        """One item's forward through the wrapper and its backward into ``.grad``."""
        try:
            total = ddp(lambda: runner.loss(sample))
        except (DataError, ConfigError) as e:
            raise type(e)(f"item {j}: {e}") from e
        except RuntimeError as e:
            if "Expected to have finished reduction" in str(e):  # DDP's own check, before the forward
                raise ConfigError(
                    "engine='ddp': a trainable parameter got no gradient in the previous update (unused by the "
                    "forward, or only on some items): DDP waits for every parameter's gradient unless told; "
                    "train with engine=leantrain.DDP(find_unused_parameters=True), or freeze the unused "
                    "parameters (requires_grad=False)") from e
            raise
        count = ddp.module.count
        if not total.is_floating_point() or not total.requires_grad:
            raise ConfigError("Runner.loss: the loss must be a floating-point tensor autograd built (was it "
                              "detached, or computed under torch.no_grad()?)")
        scale = runner.loop.loss_scale
        try:
            (total if scale is None else total * scale[0]).backward()
        except RuntimeError as e:
            if self.state.failed:  # DDP's all-reduce failed (a peer lost): the strategy names rank and update
                raise CollectiveError(f"DDP's gradient all-reduce: {str(e).splitlines()[0]}") from e
            raise
        return total.detach() if count is None else LossSum(total.detach(), count)

    def losses_only(self, runner: Runner, mine, scratch, own):
        """Every slot frozen: the items' losses, summed and reduced; no gradient."""
        loss = None
        for j, sample in enumerate(mine):
            if j:
                scratch.reset()
            draws(runner, own, j)
            with torch.no_grad():
                item_loss = runner.loss(sample)
            loss = item_loss if loss is None else add_losses(loss, item_loss)
        return self.reduced_loss(runner, loss, True), [None] * len(runner.params)

    def reduced_loss(self, runner: Runner, loss, want_loss: bool):
        """The update's loss summed over the ranks (one float64 all-reduce of a pair for a
        ``LossSum``: its count divides the gradients; a scalar only when asked for)."""
        group = distributed.group()
        if sums_losses(runner, loss):
            pair = torch.zeros(2, dtype=torch.float64, device=runner.device) if loss is None else torch.stack(
                [loss.total.to(torch.float64), torch.as_tensor(loss.count, device=loss.total.device)
                 .to(torch.float64)])
            dist.all_reduce(pair, group=group)
            dtype = torch.float32 if loss is None else loss.total.dtype
            return LossSum(pair[0].to(dtype), pair[1])  # the count stays on the device: never read back
        if not want_loss:
            return torch.zeros((), device=runner.device)  # not asked for: never read
        total = torch.zeros((), dtype=torch.float64, device=runner.device) if loss is None \
            else loss.to(torch.float64)
        dist.all_reduce(total, group=group)
        return total.to(torch.float32 if loss is None else loss.dtype)


class DDPStrategy(DataParallelStrategy):
    """A loop under ``torch.distributed`` with ``engine="ddp"``: data parallel's start,
    decisions and checkpoints (rank 0 writes leantrain's own file of the plain module),
    torch's DDP for the gradients. The wrapper is dropped when the run ends."""

    def __init__(self, settings: ParallelOptions, local: bool = False) -> None:
        super().__init__(settings, local, TorchDDP(settings.engine, local))

    def start_replicas(self, op: str, runner: Runner) -> None:
        super().start_replicas(op, runner)
        runner.one_leaf_per_tensor = True  # a tie: the module's own Parameter at each use (DDP reduces it)
        runner.recheck()

    def start(self, op: str, runner: Runner, opt, native: bool, whole=None):
        world = distributed.rank_world()[1]
        if whole is not None and world >= 3 and not self.reduction.options.find_unused_parameters:
            warnings.warn(f"{op}: engine='ddp' on {world} ranks: the resumed run ends within rounding of an "
                          f"uninterrupted one, not bit for bit. DDP reduces a new wrapper's first update in one "
                          f"bucket in the parameters' order and later updates in the buckets it rebuilds in the "
                          f"order the backward gave the gradients, and on 3 or more ranks the all-reduce adds an "
                          f"element's values in an order that depends on where it lies in its bucket: the update "
                          f"this run resumes at is summed as a first update. lt.DDP(find_unused_parameters=True) "
                          f"keeps one bucket layout throughout (exact resumes, at the cost of DDP's search for "
                          f"unused parameters)", stacklevel=5)
        return super().start(op, runner, opt, native, whole)

    def close(self, runner: Runner, failed: bool) -> None:
        self.reduction.release()
        if runner.one_leaf_per_tensor:
            runner.one_leaf_per_tensor = False
            runner.recheck()
        super().close(runner, failed)

    def finish(self, runner: Runner) -> None:
        self.close(runner, failed=False)  # the run ended well: the wrapper goes, the module as it was
