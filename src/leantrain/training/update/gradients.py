"""An update's gradients: buffers first, then every item at one parameter point (spec §7.1).

A list batch is gradient accumulation. In train mode the buffers advance for every
item first (one no-gradient forward per item, once the model is known to write
buffers); then every item is differentiated at the same parameter point and against
the same, fully advanced buffers, and the options' ``Reduction`` makes the mean (one
process: the left-to-right fold times ``1/n``, ``mean.Mean``; ``parallel/``: each rank
its share). Losses stay on the device.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..runner.binding import BufferSnapshot, rng_state, set_rng_state
from .mean import Mean
from ..runner.runner import Runner, Sample, check_sample
from ...samples import check_alike
from .options import StepOptions
from .vectorized import check_stackable
from ...errors import DataError


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
    reduction = o.reduction
    with runner.binding(op) as bound:
        if len(batch) == 1 and o.accumulation == "exact" and runner.has_buffer_updates and not reduction.ranks:
            loss, grads, snapshot = bound.one_item(op, batch[0])  # one forward, as plain PyTorch
            return Mean.of_sums(loss, grads, 1, o.scaler is None), snapshot
        rng = rng_state(runner.device) if runner.has_buffer_updates else None
        states = reduction.draw_states(runner)  # where each item's random draws start (data parallel)
        while True:
            ran, snapshot = bound.advance_buffers(op, batch, states=states, probe=reduction.ranks)  # every item first
            runner.counted_buffer_pass(ran)
            if states is not None:
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
            if ran or not scratch.written:
                if rng is not None and not ran:
                    runner.learned_buffer_writes(False)  # seen: a forward writes no buffer
                return mean, snapshot
            # The model wrote a buffer although none was seen written before: redo the
            # step with the buffer pass (the real buffers were not touched; the
            # generators replay, so the redone step draws the same numbers).
            if reduction.ranks:  # one rank cannot redo a step the others have done
                raise DataError(f"{op}: the model wrote a buffer in this step although its first data-parallel "
                                f"step wrote none (a buffer written only for some inputs); under "
                                f"torch.distributed the ranks cannot redo one step apart")
            runner.learned_buffer_writes(True)
            runner.counted_redo()
            set_rng_state(runner.device, rng)
