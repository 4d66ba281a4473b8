"""The run-level ``Strategy``: how the processes of a run start, save and end it.

Chosen once when a loop starts (``choose.py``), as Lightning's ``Strategy`` is; the
session and its components call it and never ask which one they got. It owns the
update's seam, ``strategy.reduction`` (``update/reduction.py``: what one update calls),
and everything else that differs between one process, data parallel and sharding:

* the start: every rank agrees on the run (``agree_on_start``), sees the checkpoint
  folder (``check_shared``), holds the same parameters (``start_replicas``), and gets its
  optimizer history (``start``) and moving average (``ema``);
* around each update: the checks a rank makes before it (``before_update``) and the guard
  around the model's calls (``guard``), where ``watches_updates`` says there are any;
* between updates: the context the user's code runs in (``user_code``), a checkpoint
  written (``save``), a measured loss (``mean_loss``), the job's decisions, taken once
  and shared by every rank (``any_rank``: a stop; ``from_main``: rank 0's value);
* the end: ``finish`` (a run that ended well), ``close`` (any end, the module the user's
  again), ``failed`` (how an error met inside the loop is reported).

``Strategy`` itself is **one process**: nothing to agree, one file per checkpoint.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, NoReturn, Optional

from ...errors import CheckpointError
from ...io.checkpoint import save_checkpoint
from ...optim import OptState, Optimizer
from ..runner.ema import EMA, restored_ema
from ..runner.runner import Runner, Sample
from ..update.reduction import ONE_PROCESS, Reduction

NOTHING = contextlib.nullcontext()  # a context that does nothing (reusable: it keeps no state)


class Strategy:
    """One process (the base every parallel strategy refines)."""

    #: the strategy's name, for messages and the run's report
    name = "one process"
    #: this process logs and writes the run's one-file checkpoints
    main = True
    #: a resumed optimizer state is read into host memory (each rank moves its share)
    host_state = False
    #: the strategy checks each update's batch or guards its model calls (one process: neither)
    watches_updates = False
    #: the run ends with the module whole (parameter sharding may end it released: gather_at_end)
    ends_whole = True

    def __init__(self, reduction: Reduction = ONE_PROCESS) -> None:
        self.reduction = reduction

    # ------------------------------------------------------------------ start

    def resume_ranges(self, runner, cfg):
        """What of a resumed checkpoint this process reads (``None``: all of it)."""
        return None

    def resumed(self, runner, ranged: dict) -> None:
        """A resume's load installed the slots (``ranged``: those it handed back instead)."""
        runner.unfilled = {}

    def agree_on_start(self, op: str, what: dict) -> None:
        """Every rank starts the same run, or every rank raises: ``what["refused"]`` (why
        the run cannot start, on the rank that found it) as a ``CheckpointError``, or ranks
        that run different loops (one process: only the refusal)."""
        if what.get("refused"):
            raise CheckpointError(what["refused"])

    def check_shared(self, op: str, checkpoint_path) -> None:
        """Every rank sees where the checkpoints go (one process: nothing to compare)."""
        return None

    def start_replicas(self, op: str, runner: Runner, check: bool) -> None:
        """The ranks' parameters made alike before the first update (``check``: compared
        first); a lost peer is reported as ``failed`` says."""
        return None

    def start(self, op: str, cfg, runner: Runner, opt: Optimizer, native: bool,
              whole: Optional[OptState] = None) -> OptState:
        """The loop's optimizer history: fresh, or ``whole`` (a resumed checkpoint's)."""
        return whole if whole is not None else opt.init(runner.params, native=native)

    def ema(self, runner: Runner, decay: float, saved=None):
        """The loop's moving average: fresh, or a checkpoint's ``saved`` record."""
        return EMA(runner.params, decay) if saved is None else restored_ema(runner.params, saved)

    # ------------------------------------------------------------- updates
    def before_update(self, op: str, runner: Runner, batch: list) -> None:
        """What is checked before each update (called where ``watches_updates``)."""
        return None

    def guard(self, op: str):
        """A context around a loop's calls of the model (parameter sharding checks them
        until its first update is applied)."""
        return NOTHING

    def user_code(self):
        """A context around the user's code between updates (parameter sharding: the
        parameters whole)."""
        return NOTHING

    def save(self, path, runner: Runner, state: OptState, progress: dict, loader_state, ema,
             identity: Optional[dict] = None, *, averaged: Optional[dict] = None) -> None:
        """Write one checkpoint (``loader_state`` may be a function asked only when a
        file is written; ``identity``: the run's and the file's ids)."""
        if self.main:
            if callable(loader_state):
                loader_state = loader_state()
            save_checkpoint(path, runner, state=state, progress=progress, loader_state=loader_state, ema=ema,
                            identity=identity, averaged=averaged)

    def mean_loss(self, runner: Runner, samples: Iterable[Sample]) -> Optional[float]:
        """A measured mean loss over ``samples`` (this process's)."""
        return runner.mean_loss(samples)

    def any_rank(self, flag: bool) -> bool:
        """One decision for the job (a stop): true on every rank when any rank says so."""
        return flag

    def from_main(self, value):
        """Rank 0's ``value`` on every rank (the run's id, an evaluation's results)."""
        return value

    # ------------------------------------------------------------------- end
    def finish(self, runner: Runner) -> None:
        """What a run does when its loop ends, before its ``after`` loss."""
        return None

    def close(self, runner: Runner, failed: bool) -> None:
        """The loop ended (``failed``: by an exception): the module as the user owns it."""
        return None

    def failed(self, op: str, e: RuntimeError, where: str, last: str) -> NoReturn:
        """Re-raise a runtime error met inside the loop (one process: as it is)."""
        raise e


ONE_PROCESS_RUN = Strategy()
