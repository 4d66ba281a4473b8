"""The seam between one update and parallelism: a ``Reduction``, chosen once per loop.

How the processes of a run share an update is one object, chosen when a loop (or a
public one-update call) starts, the way Lightning's ``Strategy`` and torchtitan's
build-time ``parallelize`` choose it; the update never asks which one it got. An update
reads the same for every strategy (``step.update``):

    check the batch, the history, the mean (``reduction.mean``), the sparse check,
    ``reduction.agree`` on the non-finite flag, raise if set, ``reduction.apply``,
    ``reduction.after``.

The seam holds what an update calls and nothing else: how the run starts, saves and
finishes is the run-level ``Strategy``'s (``parallel/strategy.py``), which owns its
``Reduction``. Three facts of the buffer pass and the mean are the reduction's own
flags and methods: ``direct`` (a one-item update may take one forward, writing the
buffers as it goes), ``probes`` (buffer writes are probed on every update until known,
so every rank learns alike), ``draw_states`` (each item's generator state) and ``redo``
(whether a step whose model wrote a buffer unseen before may be redone).

``Reduction`` itself is **one process**: the items' left-to-right fold times ``1/n``,
applied by the optimizer as it is (``clipped`` and ``apply`` below: clipping, skip mode,
the loss scale; no host read). ``parallel/`` holds the others (data parallel,
overlapped or exact, rank-local or not; sharding), each a subclass that overrides where
ranks take part. Nothing in this floor imports ``torch.distributed``, ``io/`` or the
moving average.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ...optim import OptState, Optimizer
from ...optim.clipping import clip_
from ...params.packs import canonical_gradients
from ..runner.binding import BufferSnapshot
from ..runner.runner import Runner, Sample
from .mean import Mean, Pack, sum_items
from .options import StepOptions
from .vectorized import stacked_loss_and_gradients


class Reduction:
    """One process (the base every parallel reduction refines)."""

    #: the reduction's name, for messages and the run's report
    name = "one process"
    #: more than one process computes each update
    ranks = False
    #: each rank's batches hold its own items only (rank-local data)
    local = False
    #: a one-item update may take one forward with the buffers written as it goes (plain
    #: PyTorch's step); a reduction that shares or cuts the update computes every item alike
    direct = True
    #: buffer writes are probed on every update until known (every rank learns alike)
    probes = False
    #: the update's gradients are held until the next update begins (a hand loop's ``.grad``
    #: lifetime, ``loop_state.Steady.held``); a reduction across ranks lets them go at once
    holds_gradients = True

    def draw_states(self, runner: Runner) -> Optional[list]:
        """A list that receives each item's generator state (an item computed on another
        rank draws what it draws in one process), or ``None``: not needed."""
        return None

    def mean(self, runner: Runner, leaves, scratch, batch: Sequence[Sample], o: StepOptions, want_loss: bool,
             states: Optional[list]) -> Mean:
        """The update's mean loss and gradients at one parameter point. The loss is
        always computed here (one process has it for free); ``want_loss`` matters where
        it costs a collective."""
        n = len(batch)
        if o.accumulation == "vectorized":
            return Mean(*stacked_loss_and_gradients(runner, batch, leaves, scale=1.0 / n))
        own = None if states is None else states[:-1]  # item seeds (runner/item_seeds.py); else in order
        return Mean.of_sums(*sum_items(runner, batch, leaves, scratch, own), n, o.scaler is None)

    def agree(self, found: torch.Tensor, o: StepOptions) -> None:
        """Make the non-finite flag one verdict for every rank (one process: its own)."""
        return None

    def apply(self, runner: Runner, opt: Optimizer, state: OptState, grads: Pack, found: torch.Tensor,
              snapshot: Optional[BufferSnapshot], o: StepOptions) -> tuple[OptState, Optional[torch.Tensor]]:
        """Clip as asked and run the optimizer; returns the state and the norm before
        clipping (clipping by norm)."""
        grads, norm = clipped(runner, grads, o)
        return apply(runner, opt, state, grads, found, snapshot, o), norm

    def after(self, runner: Runner, advanced: bool) -> None:
        """After an applied update (``advanced``: its buffer pass wrote buffers)."""
        return None

    def redo(self, op: str) -> None:
        """A step whose model wrote a buffer although none was seen written before is
        redone with the buffer pass (one process: the real buffers were not touched)."""
        return None


ONE_PROCESS = Reduction()


# ---------------------------------------------------------------- applying
def clipped(runner: Runner, grads: Pack, o: StepOptions) -> tuple[Pack, Optional[torch.Tensor]]:
    """The gradients clipped as ``o`` asks, on the canonical gradients (each storage once,
    a tie with its sum), and the norm before clipping (clipping by norm); else as given."""
    if not o.clipping:
        return grads, None
    smap = runner.slot_map()
    if not runner.slots_plain():  # a tie or a frozen slot: each storage's one gradient
        grads = canonical_gradients(smap, grads, allow_missing=True)
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
        runner.counted_layout()
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

