"""The public one-update calls: ``step_batch``, ``mean_gradients`` and their loss-reading forms.

Each call chooses its ``Reduction`` once when it starts, as a loop does
(``parallel.choose``: under ``torch.distributed`` every rank computes its
share of the items, as data parallel), then runs one update (``update.step``) or one
mean (``update.step.batch_mean``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ...errors import ConfigError
from ...optim import OptState, Optimizer
from ..parallel.choose import choose
from ..runner.runner import Runner, Sample
from ..update.step import batch_mean, check_batch
from ..update.mean import Pack
from ..update.options import StepOptions
from ..update.step import Update, update


def _step(op: str, runner: Runner, opt: Optimizer, state: OptState, native: bool, batch: Sequence[Sample],
          want_loss: bool, options: dict) -> Update:
    """The body ``step_batch`` and ``step_batch_and_loss`` share: the options (the keyword
    arguments both take, ``STEP_OPTIONS``) checked, one update."""
    unknown = sorted(set(options) - set(STEP_OPTIONS))
    if unknown:
        raise ConfigError(f"{op}: unknown argument {unknown[0]!r} (it takes {', '.join(STEP_OPTIONS)})")
    o = StepOptions.checked(op, native=native, reduction=choose().reduction, **options)
    return update(op, runner, opt, state, batch, o, want_loss)


# The keyword arguments of the one-update calls, with their defaults (StepOptions' fields).
STEP_OPTIONS = {"accumulation": "exact", "nonfinite": "raise", "skipped": None, "clip_grad_norm": None,
                "clip_grad_value": None}


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
    options = dict(accumulation=accumulation, nonfinite=nonfinite, skipped=skipped, clip_grad_norm=clip_grad_norm,
                   clip_grad_value=clip_grad_value)
    return _step("step_batch", runner, opt, state, use_native_singleton, batch, False, options).state


def step_batch_and_loss(runner: Runner, opt: Optimizer, state: OptState, use_native_singleton: bool,
                        batch: Sequence[Sample], **options) -> tuple[OptState, float]:
    """``step_batch``, also returning the batch's mean loss measured before the update
    (one host read: a sync on CUDA). Takes ``step_batch``'s keyword arguments
    (``accumulation``, ``nonfinite``, ``skipped``, ``clip_grad_norm``,
    ``clip_grad_value``, the same defaults) and raises its errors."""
    done = _step("step_batch_and_loss", runner, opt, state, use_native_singleton, batch, True, options)
    return done.state, float(done.loss.item())  # intentional sync: the caller asked for the loss


def mean_gradients(runner: Runner, batch: Sequence[Sample], *, accumulation: str = "exact") -> Pack:
    """Mean per-slot gradients of a nonempty batch at one parameter point: ``None`` at
    frozen slots and at slots no item used (torch's ``.grad is None``); a slot some items
    used has the sum over those items times ``1/n``. Each gradient is dense in its
    parameter's layout and in memory of its own."""
    op = "mean_gradients"
    o = StepOptions.checked(op, accumulation=accumulation, reduction=choose().reduction)
    return batch_mean(op, runner, check_batch(op, batch), o)[0].gradients()


def mean_loss_and_gradients(
    runner: Runner, batch: Sequence[Sample], *, accumulation: str = "exact"
) -> tuple[float, Pack]:
    """Mean loss and mean gradients; reads the loss back to the host (a sync on CUDA)."""
    op = "mean_loss_and_gradients"
    o = StepOptions.checked(op, accumulation=accumulation, reduction=choose().reduction)
    mean, _ = batch_mean(op, runner, check_batch(op, batch), o, want_loss=True)
    return float(mean.loss.item()), mean.gradients()  # intentional sync: the caller asked for the loss
