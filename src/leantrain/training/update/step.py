"""One update: the batch's mean gradient, then one optimizer call (spec §7.1-§7.2).

``update`` reads top to bottom as its phases: gather (the batch checked), the history
checked (once per loop), buffers and gradients (``gradients.batch_mean``: the buffers
advance for every item first, then every item is differentiated at one point and the
sums are multiplied by ``1/n``), the non-finite check, clipping, and the optimizer's
apply. A rejected step leaves parameters, optimizer state and buffers as they were.
Losses stay on the device unless ``step_batch_and_loss`` is called, which reads one
scalar back (a sync on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ...errors import NonFiniteError
from ...optim import OptState, Optimizer
from ...optim.clipping import clip_
from ...params.packs import canonical_gradients
from ..parallel import distributed, rank_data
from ..parallel.sharding import comm as shard_comm, step as shard_step
from ..runner.binding import BufferSnapshot
from .gradients import batch_mean, check_batch, mean_gradients, mean_loss_and_gradients  # noqa: F401
from .mean import Pack
from ..runner.runner import Runner, Sample
from .options import StepOptions


@dataclass(frozen=True)
class Update:
    """What one update returns: the new state, the mean loss measured before the update
    and, when clipping by norm, the gradient norm before clipping (device tensors: read
    only if the caller does)."""

    state: OptState
    loss: torch.Tensor
    norm: Optional[torch.Tensor] = None


def update(op: str, runner: Runner, opt: Optimizer, state: OptState, batch: Sequence[Sample], o: StepOptions,
           want_loss: bool = False) -> Update:
    """One update over a list batch, as ``o`` says (validated options, as a loop's are)."""
    batch = check_batch(op, batch, runner.loop.local and distributed.active() is not None)
    check_history(op, runner, opt, state, o)  # before buffers advance
    mean, snapshot = batch_mean(op, runner, batch, o, want_loss)
    with undone_on_error(snapshot):  # a sparse gradient the rule cannot take: refused before anything is kept
        opt.check_sparse(op, runner.params, mean.held())
    found = mean.check(snapshot.written if snapshot is not None else (),
                       o.scaler.inverse() if o.scaler is not None else None)  # the 1/n applied in the same pass
    if o.shards is not None and shard_step.keeps_ranges(o.shards, o.clip_grad_norm):
        shard_comm.flag_any(found, o.shards.world)  # each rank checked its ranges: one verdict for all
    if not o.skips:
        raise_if_nonfinite(op, found, snapshot)
    if o.shards is not None:
        state, norm = sharded_apply(runner, opt, state, mean.gradients(), found, snapshot, o)
    else:
        grads, norm = clipped(runner, mean.gradients(), o)
        state = apply(runner, opt, state, grads, found, snapshot, o)
    if snapshot is not None and runner.loop.local and distributed.active() is not None:
        rank_data.broadcast_buffers(runner)  # each rank advanced them on its own items: rank 0's, as DDP
    return Update(state, mean.loss, norm)


def check_history(op: str, runner: Runner, opt: Optimizer, state: OptState, o: StepOptions) -> None:
    """``state`` is ``opt``'s history on the options' path for the runner's slots; in a
    loop, checked at its first steady step only."""
    steady = runner.loop.steady
    if steady is None or steady.checked is not opt:
        opt.check(op, state, runner.params, o.path)
        if steady is not None:
            steady.checked = opt


class undone_on_error:
    """A context that puts the buffers back as ``snapshot`` holds them if the block raises."""

    __slots__ = ("snapshot",)

    def __init__(self, snapshot: Optional[BufferSnapshot]) -> None:
        self.snapshot = snapshot

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, *exc) -> None:
        if kind is not None and self.snapshot is not None:
            self.snapshot.restore()


def raise_if_nonfinite(op: str, found: torch.Tensor, snapshot: Optional[BufferSnapshot]) -> None:
    """``nonfinite="raise"``: nothing is updated when the flag is set, buffers included."""
    if found.item():  # intentional host read of one flag per step: raise mode must know before updating
        if snapshot is not None:
            snapshot.restore()
        raise NonFiniteError(
            f"{op}: the loss, a gradient or a buffer the step wrote is NaN or infinite; "
            f"nothing was updated, buffers included (use nonfinite='skip' to skip such steps)"
        )


def clipped(runner: Runner, grads: Pack, o: StepOptions) -> tuple[Pack, Optional[torch.Tensor]]:
    """The gradients clipped as ``o`` asks, on the canonical gradients (each storage once,
    a tie with its sum), and the norm before clipping (clipping by norm); else as given."""
    if not o.clipping:
        return grads, None
    grads = canonical_gradients(runner.slot_map(), grads, allow_missing=True)
    return grads, clip_(grads, o.clip_grad_norm, o.clip_grad_value)


def apply(runner: Runner, opt: Optimizer, state: OptState, grads: Pack, found: torch.Tensor,
          snapshot: Optional[BufferSnapshot], o: StepOptions) -> OptState:
    """The optimizer's update; in skip mode undone on the device where ``found`` is set
    (the buffers too), the skip counted, the loss scale adjusted. No host read."""
    skipping(found, snapshot, o)
    steady = runner.loop.steady
    kept = None if steady is None else steady.layout
    # The gradients come from the runner's own slots: their shapes and dtypes fit.
    state = opt.apply(state, runner.params, grads, o.path, found_inf=found if o.skips else None,
                      presummed=o.clipping, cache=steady, slots_map=runner.slot_map())
    if steady is None or steady.layout is None or steady.layout is not kept:
        runner.stats.layouts += 1
    if o.scaler is not None:
        o.scaler.update(found)
    return state


def skipping(found: torch.Tensor, snapshot: Optional[BufferSnapshot], o: StepOptions) -> None:
    """Skip mode: the buffers put back where ``found`` is set, the skip counted."""
    if o.skips:
        if snapshot is not None:
            snapshot.restore_where(found)  # a skipped step leaves the buffers as they were
        if o.skipped is not None:
            o.skipped.add_(found[0])


def sharded_apply(runner: Runner, opt: Optimizer, state: OptState, grads: Pack, found: torch.Tensor,
                  snapshot: Optional[BufferSnapshot], o: StepOptions) -> tuple[OptState, Optional[torch.Tensor]]:
    """The update of a sharded loop (``shard_step.py``): clipping on whole gradients
    (``"optimizer"`` clipping by norm) or on the owned ranges, the owned ranges updated,
    then gathered. Returns the state and the norm before clipping."""
    skipping(found, snapshot, o)
    plan, rank = o.shards, distributed.rank_world()[0]
    sums, norm, presummed = None, None, False
    if not shard_step.keeps_ranges(plan, o.clip_grad_norm):  # whole gradients: clip_grad_norm_'s bits
        grads, norm = clipped(runner, grads, o)
        presummed = True
    elif o.clipping:
        sums = shard_step.canonical_ranges(plan, rank, grads)
        norm = shard_step.clip_ranges(plan, rank, sums, o.clip_grad_norm, o.clip_grad_value,
                                      [v.storage.working() for v in runner.params])
    state = shard_step.apply(runner, opt, state, plan, rank, grads, found if o.skips else None, presummed, sums)
    if o.scaler is not None:
        o.scaler.update(found)
    return state, norm


def _step(op: str, runner: Runner, opt: Optimizer, state: OptState, native: bool, batch: Sequence[Sample],
          want_loss: bool, **options) -> Update:
    """The body ``step_batch`` and ``step_batch_and_loss`` share: options checked, one update."""
    return update(op, runner, opt, state, batch, StepOptions.checked(op, native=native, **options), want_loss)


def step_batch(
    runner: Runner,
    opt: Optimizer,
    state: OptState,
    use_native_singleton: bool,
    batch: Sequence[Sample],
    *,
    accumulation: str = "exact",
    nonfinite: str = "raise",
    skipped: Optional[torch.Tensor] = None,
    clip_grad_norm: Optional[float] = None,
    clip_grad_value: Optional[float] = None,
) -> OptState:
    """One optimizer update over the batch's mean gradient, without reading a loss.

    Unlike upstream's seed-era loop, a native loop keeps list batches native too (the
    mean is taken on the device).

    Args:
        runner: the model, its loss and its slots.
        opt: the optimizer ``state`` belongs to.
        state: the optimizer history (``opt.init(runner.params, native=...)``).
        use_native_singleton: the update path for the whole loop (the state was made for
            it): the native device path when true, the generic host path otherwise.
        batch: a nonempty list of items, one structure (the accumulation contract).
        accumulation: ``"exact"`` (item by item) or ``"vectorized"`` (stacked).
        nonfinite: ``"raise"`` checks the loss and gradients before updating (one flag
            read per step, a sync on CUDA); ``"skip"`` never reads the host: the update
            is undone on the device where the flag is set.
        skipped: a device tensor that counts the skipped updates (``"skip"``).
        clip_grad_norm: clip the mean canonical gradients to this global L2 norm.
        clip_grad_value: clip them elementwise to this value.

    Returns:
        The new optimizer state (the runner's parameters are updated in place).

    Raises:
        DataError: an empty or malformed batch, a sample the model rejects.
        NonFiniteError: a non-finite loss, gradient or written buffer (``"raise"``);
            nothing was updated, buffers included.
        OptimizerStateError: ``state`` does not fit the slots or the path.
    """
    return _step("step_batch", runner, opt, state, use_native_singleton, batch, False, accumulation=accumulation,
                 nonfinite=nonfinite, skipped=skipped, clip_grad_norm=clip_grad_norm,
                 clip_grad_value=clip_grad_value).state


def step_batch_and_loss(
    runner: Runner,
    opt: Optimizer,
    state: OptState,
    use_native_singleton: bool,
    batch: Sequence[Sample],
    *,
    accumulation: str = "exact",
    nonfinite: str = "raise",
    skipped: Optional[torch.Tensor] = None,
    clip_grad_norm: Optional[float] = None,
    clip_grad_value: Optional[float] = None,
) -> tuple[OptState, float]:
    """``step_batch``, also returning the batch's mean loss measured before the update
    (one host read: a sync on CUDA). Same arguments and errors as ``step_batch``."""
    done = _step("step_batch_and_loss", runner, opt, state, use_native_singleton, batch, True,
                 accumulation=accumulation, nonfinite=nonfinite, skipped=skipped, clip_grad_norm=clip_grad_norm,
                 clip_grad_value=clip_grad_value)
    return done.state, float(done.loss.item())  # intentional sync: the caller asked for the loss
