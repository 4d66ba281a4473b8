"""One update: the batch's mean gradient, then one optimizer call (spec §7.1-§7.2).

A list batch is gradient accumulation. In train mode the buffers advance for every item
first (one no-gradient forward per item, once the model is known to write buffers);
then every item is differentiated at the same parameter point and against the same,
fully advanced buffers, and the options' ``Reduction`` makes the mean (one process: the
left-to-right fold times ``1/n``, ``mean.Mean``; ``parallel/``: each rank its share).

``update`` reads top to bottom as its phases, the same for one process and for every
parallel strategy (the options' ``Reduction``, chosen once per loop, owns what differs):
the batch checked, the history checked (once per loop), buffers and gradients
(``batch_mean``, as above), the sparse check,
the ranks' one verdict on the non-finite flag, the non-finite check, the reduction's
apply (clipping and the optimizer), and what the reduction does after. A rejected step
leaves parameters, optimizer state and buffers as they were. Losses stay on the device
unless the caller reads ``Update.loss``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ...errors import DataError, NonFiniteError
from ...optim import OptState, Optimizer
from ...samples import check_alike
from ..runner.binding import BufferSnapshot, rng_state, set_rng_state
from ..runner.runner import Runner, Sample, check_sample
from ..runner.item_seeds import seeded_states
from .mean import Mean
from .options import StepOptions
from .vectorized import check_stackable


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
    reduction = o.reduction
    runner.confirm_steady()  # in a loop, after the user's code ran: what was checked still holds, or check again
    batch = check_batch(op, batch, reduction.local)
    check_history(op, runner, opt, state, o)  # before buffers advance
    mean, snapshot = batch_mean(op, runner, batch, o, want_loss)
    with undone_on_error(snapshot):  # a sparse gradient the rule cannot take: refused before anything is kept
        opt.check_sparse(op, runner.params, mean.held())
    found = mean.flag_nonfinite(snapshot.written if snapshot is not None else (),
                                o.scaler.inverse() if o.scaler is not None else None)  # the 1/n in the same pass
    reduction.agree(found, o)
    if not o.skips:
        raise_if_nonfinite(op, found, snapshot)
    state, norm = reduction.apply(runner, opt, state, mean.gradients(), found, snapshot, o)
    reduction.after(runner, snapshot is not None)
    steady = runner.loop.steady
    if steady is not None and reduction.holds_gradients:
        steady.held = mean  # let go when the next update begins (loop_state.Steady.held)
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


# ------------------------------------------------------------ the mean
def check_batch(op: str, batch: Sequence[Sample], local: bool = False) -> list[Sample]:
    """A batch is a nonempty list of samples of one structure (``samples.py``).
    ``local``: this rank's items of a rank-local update, which the ranks' count checks
    together (``rank_data.global_count``), so that every rank raises alike."""
    if not isinstance(batch, (list, tuple)):
        raise DataError(f"{op}: a batch is a list of (x, y) samples, got {type(batch).__name__}")
    if len(batch) == 0 and not local:
        raise DataError(f"{op}: empty batch")
    checked = [check_sample(op, s, i) for i, s in enumerate(batch)]
    if len(checked) > 1:
        check_alike(op, checked)
    return checked


def batch_mean(op: str, runner: Runner, batch: list[Sample], o: StepOptions, want_loss: bool = False
               ) -> tuple[Mean, Optional[BufferSnapshot]]:
    """The mean loss and gradients of a checked batch, the buffers advanced first;
    nothing read to the host. Also returns the buffers as they were before the step when
    it advanced any, so the caller can undo a rejected step (a model error undoes them
    here)."""
    if o.accumulation == "vectorized":
        check_stackable(runner, batch)  # before the buffers move
    steady = runner.loop.steady
    if steady is not None:
        steady.held = None  # the last update's gradients go before this one's forward
    reduction = o.reduction
    with runner.binding(op) as bound:
        if len(batch) == 1 and o.accumulation == "exact" and runner.has_buffer_updates and reduction.direct \
                and not o.item_seeds:
            loss, grads, snapshot = bound.one_item(op, batch[0])  # one forward, as plain PyTorch
            return Mean.of_sums(loss, grads, 1, o.scaler is None), snapshot
        rng = rng_state(runner.device) if runner.has_buffer_updates else None
        mean, snapshot, ran, wrote = _buffers_then_mean(op, runner, bound, batch, o, want_loss)
        if wrote and not ran:
            # The model wrote a buffer although none was seen written before: redo the
            # step with the buffer pass (the real buffers were not touched; the
            # generators replay, so the redone step draws the same numbers).
            reduction.redo(op)  # refused where ranks computed the step together
            runner.learned_buffer_writes(True)
            runner.counted_redo()
            set_rng_state(runner.device, rng)
            mean, snapshot, _, _ = _buffers_then_mean(op, runner, bound, batch, o, want_loss)
        elif rng is not None and not ran:
            runner.learned_buffer_writes(False)  # seen: a forward writes no buffer
        return mean, snapshot


def _buffers_then_mean(op: str, runner: Runner, bound, batch: list[Sample], o: StepOptions, want_loss: bool
                       ) -> tuple[Mean, Optional[BufferSnapshot], bool, bool]:
    """The buffer pass (every item first, where it runs), then the reduction's mean with
    the buffers held fixed. Also returns whether the buffer pass ran and whether a
    gradient pass wrote a buffer (without the pass: the step must be redone with it)."""
    reduction = o.reduction
    seeded = o.item_seeds and runner.mode == "train" and bound.draws_numbers(op, batch)
    # where each item's random draws start: seeded per item, or as one process draws them (data parallel)
    states = seeded_states(runner.device, len(batch)) if seeded else reduction.draw_states(runner)
    ran, snapshot = bound.advance_buffers(op, batch, states=states, probe=reduction.probes,
                                          seeded=seeded)  # every item first
    runner.counted_buffer_pass(ran)
    if states is not None and not seeded:
        states = bound.item_states(op, batch, states if ran else None)
    try:
        with bound.scratch_buffers() as scratch:  # gradient passes leave buffers be
            mean = reduction.mean(runner, bound.leaves, scratch, batch, o, want_loss, states)
    except BaseException:
        if snapshot is not None:
            snapshot.restore()
        raise
    if states is not None:
        set_rng_state(runner.device, states[-1])  # every rank where one process ends
    return mean, snapshot, ran, bool(scratch.written)
