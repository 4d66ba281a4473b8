"""One update: mean gradients over a list batch, then one optimizer call (spec §7.1-§7.2).

A list batch is gradient accumulation. Buffers advance for every item first
(train mode only); then every item is differentiated at the same parameter point
and the same, fully advanced buffers; gradients are summed left to right and
multiplied by ``1/n``; the optimizer runs once. Losses stay on the device unless a
``*_and_loss`` function is called, which reads one scalar back (a sync on CUDA).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import distributed
from . import dp_gradients as dp
from .accumulate import Pack, scale, sum_items
from ..errors import DataError, NonFiniteError
from ..validate import check_choice
from ..optim import OptState, Optimizer
from ..optim.clipping import check_clip, clip_
from ..params.packs import canonical_gradients
from ..optim.optimizer import GENERIC, NATIVE
from .binding import BufferSnapshot, rng_state, set_rng_state
from .precision import LossScaler
from .config import ACCUMULATION_MODES, NONFINITE_MODES
from .runner import Runner, Sample, check_sample


def _check_batch(op: str, batch: Sequence[Sample]) -> list[Sample]:
    if not isinstance(batch, (list, tuple)):
        raise DataError(f"{op}: a batch is a list of (x, y) samples, got {type(batch).__name__}")
    if len(batch) == 0:
        raise DataError(f"{op}: empty batch")
    return [check_sample(op, s, i) for i, s in enumerate(batch)]


def _gradients(
    runner: Runner, leaves, scratch, batch: Sequence[Sample], accumulation: str, want_loss: bool,
    exact_reduction: bool = False, defer: bool = False, states: Optional[list] = None,
) -> tuple[torch.Tensor, Pack, Optional[float]]:
    """(mean loss, mean gradients, None) at one parameter point: left-to-right sums times
    ``1/n`` (with ``defer``, possibly the sums and ``1/n`` still to apply: see ``accumulate.scale``).

    Under ``torch.distributed`` each rank differentiates its share of the items and the
    sums are all-reduced (see ``distributed.py``); the loss joins only if ``want_loss``.
    """
    n, group = len(batch), distributed.active()
    if group is None:
        if accumulation == "vectorized":
            return (*runner.stacked_loss_and_gradients(batch, leaves, scale=1.0 / n), None)
        loss, grads = sum_items(runner, batch, leaves, scratch)
        if n == 1:
            return loss, grads, None  # g * (1/1) is g, bit for bit: skip the pass
        return scale(loss, grads, 1.0 / n, defer)
    if exact_reduction:
        return (*dp.exact_gradients(runner, leaves, scratch, batch, *group, states), None)
    own = None if states is None else distributed.my_items(states[:-1], *group)
    loss, grads = dp.overlapped_sums(runner, leaves, scratch, distributed.my_items(batch, *group), accumulation,
                                   want_loss, own)
    if loss is None:
        loss = torch.zeros((), device=runner.device)  # not asked for: never read
    return scale(loss, grads, 1.0 / n, defer)


def _accumulate(
    op: str, runner: Runner, batch: Sequence[Sample], accumulation: str = "exact",
    want_loss: bool = False, exact_reduction: bool = False, defer: bool = False,
) -> tuple[torch.Tensor, Pack, Optional[BufferSnapshot], Optional[float]]:
    """Buffers first, then (mean loss, mean gradients) of a checked batch; nothing read
    to the host. Also returns the buffers as they were before the step when it advanced
    any, so the caller can undo a rejected step (a model error undoes them here), and
    the ``1/n`` still to apply with ``defer`` (``None``: applied)."""
    if accumulation == "vectorized":
        runner.check_stackable(batch)  # before the buffers move
    with runner.binding(op) as bound:
        if len(batch) == 1 and accumulation == "exact" and runner.has_buffer_updates and distributed.active() is None:
            return (*bound.one_item(op, batch[0]), None)  # one forward, as plain PyTorch
        rng = rng_state(runner.device) if runner.has_buffer_updates else None
        # Data parallel: where each item's random draws start in one process (dropout).
        states = [] if distributed.active() is not None and runner.mode == "train" and runner.draws is not False \
            else None
        while True:
            ran, snapshot = bound.advance_buffers(op, batch, states=states)  # every item, before any gradient
            if states is not None:
                states = dp.item_states(runner, bound, op, batch, states if ran else None)
            try:
                with bound.scratch_buffers() as scratch:  # gradient passes leave buffers be
                    loss, grads, pending = _gradients(runner, bound.leaves, scratch, batch, accumulation,
                                                      want_loss, exact_reduction, defer, states)
            except BaseException:
                if snapshot is not None:
                    snapshot.restore()
                raise
            if states is not None:
                set_rng_state(runner.device, states[-1])  # every rank where one process ends
            if ran or not scratch.written:
                if rng is not None and not ran:
                    runner.buffer_writes = False  # seen: a forward writes no buffer
                return loss, grads, snapshot, pending
            # The model wrote a buffer although none was seen written before: redo the
            # step with the buffer pass (the real buffers were not touched; the
            # generators replay, so the redone step draws the same numbers).
            runner.buffer_writes = True
            set_rng_state(runner.device, rng)


def mean_gradients(runner: Runner, batch: Sequence[Sample], *, accumulation: str = "exact") -> Pack:
    """Mean per-slot gradients of a nonempty batch at one parameter point: ``None`` at
    frozen slots and at slots no item used (torch's ``.grad is None``); a slot some items
    used has the sum over those items times ``1/n``. Each gradient is dense in its
    parameter's layout and in memory of its own."""
    op = "mean_gradients"
    check_choice(op, "accumulation", accumulation, ACCUMULATION_MODES)
    return _accumulate(op, runner, _check_batch(op, batch), accumulation)[1]


def mean_loss_and_gradients(
    runner: Runner, batch: Sequence[Sample], *, accumulation: str = "exact"
) -> tuple[float, Pack]:
    """Mean loss and mean gradients; reads the loss back to the host (a sync on CUDA)."""
    op = "mean_loss_and_gradients"
    check_choice(op, "accumulation", accumulation, ACCUMULATION_MODES)
    loss, grads, _, _ = _accumulate(op, runner, _check_batch(op, batch), accumulation, True)
    return float(loss.item()), grads  # intentional sync: the caller asked for the loss


_FLAGS: dict = {}  # per device: (a reusable flag, a unit scale)
_MEANS: dict = {}  # per (device, 1/n): the float32 factor as a one-element tensor


def nonfinite_flag(loss: torch.Tensor, grads: Pack, buffers: Sequence[torch.Tensor] = (),
                   inv_scale: Optional[torch.Tensor] = None, mean: Optional[float] = None) -> torch.Tensor:
    """A one-element device tensor: 1.0 when the loss, any gradient or any of
    ``buffers`` (those the step's buffer pass wrote) is NaN or infinite.

    One fused kernel (the one ``GradScaler`` uses) with a unit scale, which leaves the
    values bit for bit as they are; with ``inv_scale`` (float16 loss scaling) the
    gradients are unscaled by it in the same pass, and with ``mean`` (a deferred ``1/n``
    of float32 gradients, see ``_scale``) they are multiplied by it there. Nothing is
    read to the host.
    """
    device = loss.device
    pair = _FLAGS.get(device)
    if pair is None:
        pair = _FLAGS[device] = (torch.zeros(1, device=device), torch.ones(1, device=device))
    found, unit = pair
    found.zero_()  # reused every step: stream order keeps the last step's reads before this
    # the values of a sparse gradient are what it holds (unscaled in place with it)
    grads = [g if g.layout == torch.strided else g._values() for g in grads if g is not None]
    if mean is not None:
        factor = _MEANS.get((device, mean))
        if factor is None:
            if len(_MEANS) > 64:
                _MEANS.clear()
            factor = _MEANS[(device, mean)] = torch.full((1,), mean, dtype=torch.float32, device=device)
        inv_scale = factor  # float32(1/n): the factor ``g.mul_(1/n)`` multiplies float32 by
    if inv_scale is None:
        torch._amp_foreach_non_finite_check_and_unscale_([loss.detach().view(1)] + grads + list(buffers), found, unit)
        return found
    if grads:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)
    torch._amp_foreach_non_finite_check_and_unscale_([loss.detach().view(1)] + list(buffers), found, unit)
    return found


def update(
    op: str, runner: Runner, opt: Optimizer, state: OptState, native: bool, batch: list[Sample],
    accumulation: str = "exact", *, want_loss: bool = False, nonfinite: str = "raise",
    skipped: Optional[torch.Tensor] = None, exact_reduction: bool = False,
    clip_grad_norm: Optional[float] = None, clip_grad_value: Optional[float] = None,
    scaler: Optional[LossScaler] = None,
) -> tuple[OptState, torch.Tensor, Optional[torch.Tensor]]:
    """One update over a list batch (the modes already validated, as the loops' configs
    are); returns the new state, the mean loss tensor and, when clipping by norm, the
    gradient norm before clipping (device tensors: read only if the caller does)."""
    path = NATIVE if native else GENERIC
    batch = _check_batch(op, batch)
    cache = runner.steady_cache
    if cache is None or cache.get("checked") is not opt:  # in a loop: its first steady step
        opt.check(op, state, runner.params, path)  # before buffers advance
        if cache is not None:
            cache["checked"] = opt
    loss, grads, snapshot, mean = _accumulate(op, runner, batch, accumulation, want_loss, exact_reduction,
                                              defer=scaler is None)
    try:  # a sparse gradient the rule cannot take: refused before anything is kept
        opt.check_sparse(op, runner.params, grads)
    except BaseException:
        if snapshot is not None:
            snapshot.restore()
        raise
    found = nonfinite_flag(loss, grads, snapshot.written if snapshot is not None else (),
                           scaler.inverse() if scaler is not None else None, mean)
    if scaler is not None:
        nonfinite = "skip"  # float16 scaling: an overflow step is skipped and the scale backs off
    if nonfinite == "raise":
        # Intentional host read of one flag per step: raise mode must know before updating.
        if found.item():
            if snapshot is not None:
                snapshot.restore()
            raise NonFiniteError(
                f"{op}: the loss, a gradient or a buffer the step wrote is NaN or infinite; "
                f"nothing was updated, buffers included (use nonfinite='skip' to skip such steps)"
            )
    clipping = clip_grad_norm is not None or clip_grad_value is not None
    norm = None
    if clipping:  # on the canonical gradients: each storage once, a tie with its sum
        grads = canonical_gradients(runner.slot_map(), grads, allow_missing=True)
        norm = clip_(grads, clip_grad_norm, clip_grad_value)
    if nonfinite == "skip":
        if snapshot is not None:
            snapshot.restore_where(found)  # a skipped step leaves the buffers as they were
        if skipped is not None:
            skipped.add_(found[0])
        state = opt.apply(state, runner.params, grads, path, found_inf=found, presummed=clipping,
                          cache=cache, slots_map=runner.slot_map())
        if scaler is not None:
            scaler.update(found)
        return state, loss, norm
    # The gradients come from the runner's own slots: their shapes and dtypes fit.
    state = opt.apply(state, runner.params, grads, path, presummed=clipping, cache=cache, slots_map=runner.slot_map())
    return state, loss, norm


def _check_modes(op: str, accumulation: str, nonfinite: str) -> None:
    check_choice(op, "accumulation", accumulation, ACCUMULATION_MODES)
    check_choice(op, "nonfinite", nonfinite, NONFINITE_MODES)


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

    ``use_native_singleton`` picks the update path for the whole loop (the state was
    made for it): the native device path when true, the generic host path otherwise.
    Unlike upstream's seed-era loop, a native loop keeps list batches native too (the
    mean is taken on the device).

    ``nonfinite="raise"`` checks the loss and gradients before updating (one flag read
    per step, a sync on CUDA) and raises ``NonFiniteError`` with nothing changed;
    ``"skip"`` never reads the host: the update is undone on the device where the flag
    is set, and ``skipped`` (a device tensor) counts the skips. ``clip_grad_norm`` /
    ``clip_grad_value`` clip the mean canonical gradients before the update (see
    ``optim.clipping``).
    """
    _check_modes("step_batch", accumulation, nonfinite)
    check_clip("step_batch", clip_grad_norm, clip_grad_value)
    return update(
        "step_batch", runner, opt, state, use_native_singleton, batch, accumulation,
        nonfinite=nonfinite, skipped=skipped, clip_grad_norm=clip_grad_norm, clip_grad_value=clip_grad_value,
    )[0]


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
    """One update and the batch's mean loss, measured before the update."""
    _check_modes("step_batch_and_loss", accumulation, nonfinite)
    check_clip("step_batch_and_loss", clip_grad_norm, clip_grad_value)
    state, loss, _ = update(
        "step_batch_and_loss", runner, opt, state, use_native_singleton, batch, accumulation,
        want_loss=True, nonfinite=nonfinite, skipped=skipped, clip_grad_norm=clip_grad_norm,
        clip_grad_value=clip_grad_value,
    )
    return state, float(loss.item())  # intentional sync: the caller asked for the loss
