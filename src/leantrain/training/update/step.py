"""One update: the batch's mean gradient, then one optimizer call (spec §7.1-§7.2).

``update`` reads top to bottom as its phases, the same for one process and for every
parallel strategy (the options' ``Reduction``, chosen once per loop, owns what differs):
the batch checked, the history checked (once per loop), buffers and gradients
(``gradients.batch_mean``: the buffers advance for every item first, then every item is
differentiated at one point and the sums are multiplied by ``1/n``), the sparse check,
the ranks' one verdict on the non-finite flag, the non-finite check, the reduction's
apply (clipping and the optimizer), and what the reduction does after. A rejected step
leaves parameters, optimizer state and buffers as they were. Losses stay on the device
unless the caller reads ``Update.loss``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ...errors import NonFiniteError
from ...optim import OptState, Optimizer
from ..runner.binding import BufferSnapshot
from ..runner.runner import Runner, Sample
from .gradients import batch_mean, check_batch
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
