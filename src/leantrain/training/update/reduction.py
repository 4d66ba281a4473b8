"""The seam between one update and parallelism: a ``Reduction``, chosen once per loop.

How the processes of a run share an update is one object, chosen when a loop (or a
public one-update call) starts, the way Lightning's ``Strategy`` and torchtitan's
build-time ``parallelize`` choose it; the update never asks which one it got. An update
reads the same for every strategy (``step.update``):

    check the batch, the history, the mean (``reduction.mean``), the sparse check,
    ``reduction.agree`` on the non-finite flag, raise if set, ``reduction.apply``,
    ``reduction.after``.

The session asks the same object how a run starts (its optimizer history, the moving
average), what happens before each update (``check_step``), how a checkpoint is written,
how the run finishes and how a failure is reported.

``Reduction`` itself is **one process**: the items' left-to-right fold times ``1/n``,
applied by the optimizer as it is (``clipped`` and ``apply`` below: clipping, skip mode,
the loss scale; no host read). ``parallel/`` holds the others (data parallel,
overlapped or exact, rank-local or not; sharding), each a subclass that overrides where
ranks take part; ``parallel.strategy.choose`` picks one. Nothing in this floor imports
``torch.distributed``.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, NoReturn, Optional, Sequence

import torch

from ...io.checkpoint import save_checkpoint
from ...optim import OptState, Optimizer
from ...optim.clipping import clip_
from ...params.packs import canonical_gradients
from ..runner.binding import BufferSnapshot
from ..runner.ema import EMA, restored_ema
from ..runner.runner import Runner, Sample
from .accumulate import sum_items
from .mean import Mean, Pack
from .options import StepOptions
from .vectorized import stacked_loss_and_gradients


NOTHING = contextlib.nullcontext()  # a context that does nothing (reusable: it keeps no state)


class Reduction:
    """One process (the base every parallel strategy refines)."""

    #: the strategy's name, for messages and the run's report
    name = "one process"
    #: more than one process computes each update: a model's buffer writes are probed on
    #: every step until known (every rank learns alike), and a step is never redone on one
    #: rank alone
    ranks = False
    #: each rank's batches hold its own items only (rank-local data)
    local = False
    #: this process logs and writes the run's one-file checkpoints
    main = True
    #: a resumed optimizer state is read into host memory (each rank moves its share)
    host_state = False

    # ------------------------------------------------------------ one update
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
        return Mean.of_sums(*sum_items(runner, batch, leaves, scratch), n, o.scaler is None)

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

    # ------------------------------------------------------------ a loop's run
    def agree_on_start(self, op: str, what: dict) -> None:
        """Every rank starts the same run (one process: nothing to compare)."""
        return None

    def check_shared(self, op: str, checkpoint_path) -> None:
        """Every rank sees where the checkpoints go (one process: nothing to compare)."""
        return None

    def start_replicas(self, runner: Runner, check: bool) -> None:
        """The ranks' parameters made alike before the first update."""
        return None

    def start(self, op: str, cfg, runner: Runner, opt: Optimizer, native: bool,
              whole: Optional[OptState] = None) -> OptState:
        """The loop's optimizer history: fresh, or ``whole`` (a resumed checkpoint's)."""
        return whole if whole is not None else opt.init(runner.params, native=native)

    def ema(self, runner: Runner, decay: float, saved=None):
        """The loop's moving average: fresh, or a checkpoint's ``saved`` record."""
        return EMA(runner.params, decay) if saved is None else restored_ema(runner.params, saved)

    def check_step(self, op: str, runner: Runner, batch: list) -> None:
        """What is checked before each update of a loop (one process: nothing)."""
        return None

    def save(self, path, runner: Runner, state: OptState, progress: dict, loader_state, ema) -> None:
        """Write one checkpoint (``loader_state`` may be a function asked only when a
        file is written)."""
        if self.main:
            if callable(loader_state):
                loader_state = loader_state()
            save_checkpoint(path, runner, state=state, progress=progress, loader_state=loader_state, ema=ema)

    def mean_loss(self, runner: Runner, samples: Iterable[Sample]) -> Optional[float]:
        """A measured mean loss over ``samples`` (this process's)."""
        return runner.mean_loss(samples)

    def finish(self, runner: Runner) -> None:
        """What a run does when its loop ends, before its ``after`` loss."""
        return None

    def guard(self, op: str):
        """A context around a loop's calls of the model (parameter sharding checks them
        until its first update is applied)."""
        return NOTHING

    def user_code(self):
        """A context around the user's code between updates (parameter sharding: the
        parameters whole)."""
        return NOTHING

    def close(self, runner: Runner, failed: bool) -> None:
        """The loop ended (``failed``: by an exception): the module as the user owns it."""
        return None

    def failed(self, op: str, e: RuntimeError, where: str, last: str) -> NoReturn:
        """Re-raise a runtime error met inside the loop (one process: as it is)."""
        raise e


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

