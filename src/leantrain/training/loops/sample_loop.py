"""The fixed-step loop over an in-memory sample list (seed: Runtime Supervised
Training, spec §7.3).

The loop reads top to bottom: fetch a batch, schedule, update (with the loss only
when a log line is due), watch memory, tell the session. Nothing is read back to the
host between log points. ``checkpoint_path``/``checkpoint_every``/``resume_from`` in
the config make a run save itself and continue exactly (see ``session.py``).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from ...data import Dataset
from ...errors import ConfigError, DataError
from ...optim import OptState, Optimizer
from .config import TrainConfig, TrainReport, scheduled
from .memory import MemoryWatch, cadence
from ..runner.runner import Runner, Sample, check_sample
from .callbacks import Callback
from .events import Progress, StepCallback
from ..parallel import distributed
from .loop_checks import check_inputs
from .session import Log, ScheduleState, Session

def cyclic_batches(op: str, samples: Sequence[Sample], k: int, cursor: int = 0):
    """``k`` samples per call, continuing where the last call stopped and wrapping."""
    if not samples:
        raise DataError(f"{op}: empty sample cycle")
    n = len(samples)
    while True:
        batch = [samples[(cursor + j) % n] for j in range(k)]
        cursor = (cursor + k) % n
        yield batch


def run_sample_steps(
    runner: Runner,
    cfg: TrainConfig,
    next_batch: Callable[[], list[Sample]],
    watch_memory: Callable[[int], None],
    opt: Optimizer,
    state: OptState,
    schedule_state: ScheduleState,
    *,
    log: Log = print,
    start_step: int = 0,
    session: Optional[Session] = None,
) -> tuple[OptState, list[tuple[int, float]], int]:
    """The fixed-step loop from ``start_step`` to ``cfg.steps``. Returns (state, the
    (step, loss) pairs this call logged, steps done). ``session`` (the one
    ``train_samples`` runs in) hears every step; without one the loop runs bare. ``opt``
    must be the config's optimizer (the one the state belongs to)."""
    if opt != cfg.optimizer:
        raise ConfigError("run_sample_steps: opt must be cfg.optimizer (the optimizer the state was made by)")
    if session is None:
        session = Session("run_sample_steps", runner, cfg, "samples", log=log)
    first_logged = len(session.record.logged)
    step = start_step
    with runner.steady():  # checked at the first step, again after the user's code ran
        while step < cfg.steps:
            batch = next_batch()
            state = schedule_state(step, state)  # the schedule advances per optimizer step
            done = session.update(state, batch, step + 1)
            state, step = done.state, step + 1
            watch_memory(step)
            if session.after_update(done, batch, Progress(step)):
                break
    return state, session.record.logged[first_logged:], step


def train_samples(
    runner: Runner, cfg: TrainConfig, samples: Sequence[Sample], *, log: Log = print,
    callback: Optional[StepCallback] = None, callbacks: Sequence[Callback] = (),
) -> TrainReport:
    """Train on an in-memory list for ``cfg.steps`` updates of ``cfg.batch_size`` items.

    Items are taken cyclically in stored order (never shuffled); a batch may wrap
    around the end. The runner keeps the trained parameters and stays in train mode.

    Args:
        runner: the model, its loss and its slots.
        cfg: the loop's settings (optimizer, schedule, logging, checkpoints, features).
        samples: the items, a list (each a sample the model takes in one forward).
        log: called with each log line (``None``: no lines).
        callback: called with each ``StepEvent``; returning ``True`` stops the run.
        callbacks: ``Callback`` objects (loggers, early stopping, your own).

    Returns:
        The ``TrainReport``: losses before and after, the logged losses, steps,
        evaluations, skipped steps and wall time.

    Raises:
        ConfigError: a setting that does not fit the runner or the data.
        DataError: an empty or malformed sample list.
        CheckpointError: ``cfg.resume_from`` that does not fit this run (nothing changed).
    """
    op = "train_samples"
    check_inputs(op, runner, cfg, TrainConfig)
    if not (hasattr(samples, "__len__") and hasattr(samples, "__getitem__")) or isinstance(samples, (str, bytes, dict)):
        raise DataError(
            f"{op}: expected a list of (x, y) samples, got {type(samples).__name__}; a generator or "
            f"iterator is read once, so pass list(...) of it (or use train_loader for batches)"
        )
    if len(samples) == 0:
        raise DataError(f"{op}: empty sample list; nothing to train on")
    samples = [check_sample(op, s, i) for i, s in enumerate(samples)]
    n, k = len(samples), cfg.batch_size
    with distributed.collectives(cfg.parallel.collective_timeout):  # fail, not hang, on a lost peer
        session = Session(op, runner, cfg, "samples", log=log, callback=callback, callbacks=callbacks)
        with session.computing():  # autocast and the loss scale, for this loop only
            state, ck = session.start(lambda: runner.mean_loss(samples), {"batch_size": k, "n_samples": n})
            start = 0 if ck is None else ck.progress["step"]
            session.begin(cfg.steps, start)
            watch = MemoryWatch(cadence(cfg.mem_watch, cfg.steps, runner.device), cfg.steps, runner.device, session.log)
            watch(start)
            batches = cyclic_batches(op, samples, k, cursor=(start * k) % n)
            state, _, done = run_sample_steps(
                runner, cfg, lambda: next(batches), watch, cfg.optimizer, state,
                scheduled(cfg), start_step=start, session=session,
            )
            return session.finish(lambda: runner.mean_loss(samples), done, done * k)


def train_dataset(
    runner: Runner, cfg: TrainConfig, dataset: Dataset, *, log: Log = print,
    callback: Optional[StepCallback] = None, callbacks: Sequence[Callback] = (),
) -> TrainReport:
    """``train_samples`` over the dataset's items in stored order."""
    if not isinstance(dataset, Dataset):
        raise ConfigError(f"train_dataset: expected a Dataset, got {type(dataset).__name__}")
    return train_samples(runner, cfg, dataset.to_list(), log=log, callback=callback, callbacks=callbacks)
