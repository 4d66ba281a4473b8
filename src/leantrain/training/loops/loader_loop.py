"""The loader loop (seed: Runtime Supervised Training, spec §7.4): one averaged-gradient
update per loader batch (or per ``accumulate`` batches).

The loader is read lazily, one pass per epoch (``streams.py``): nothing is read ahead,
counted or kept, so memory does not grow with the data and an endless stream trains
(stopped by ``max_steps``). The schedule advances once per epoch (``schedule_per=
"step"``: once per update); the step counter (for logging) runs across epochs. A
checkpoint records the loader's position in the current epoch (its order or the
generator states it was drawn from, or the loader's own state) plus the batches done,
so a resume inside any epoch continues with the batches the interrupted run had next.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Sequence, Union

from ...data import DataLoader
from ...errors import ConfigError, DataError
from ...optim import OptState, Optimizer
from .batches import Loader, as_list_batch, examples_in, loader_generators
from ..runner.binding import rng_preserved
from .config import LoaderTrainConfig, TrainReport, lr_for
from ..runner.runner import Runner, Sample
from ...samples import split_rows
from .callbacks import Callback
from .events import StepCallback, StepEvent
from ..parallel import distributed
from .loop_checks import check_inputs
from ..parallel.rank_data import rank_local
from .session import Log, ScheduleState, Session
from .streams import Stream
from ...io.checkpoint import loader_record

@dataclass(frozen=True)
class Progress:
    """Where a loader run stands: its epoch, the loader batches done in that epoch, the
    updates done and the samples seen (what a checkpoint saves and a resume starts at)."""

    epoch: int = 0
    batch: int = 0
    step: int = 0
    seen: int = 0

    def after(self, batch: int, items: int) -> "Progress":
        """One update later, at loader batch ``batch`` of the epoch, ``items`` more seen."""
        return Progress(self.epoch, batch, self.step + 1, self.seen + items)

    def record(self) -> dict:
        """The fields a checkpoint's progress holds besides the step."""
        return {"epoch": self.epoch, "batch": self.batch, "seen": self.seen}


def run_loader_epochs(
    runner: Runner,
    cfg: LoaderTrainConfig,
    loader: Loader,
    opt: Optimizer,
    state: OptState,
    schedule_state: ScheduleState,
    *,
    log: Log = print,
    start: Union[Progress, tuple[int, int, int, int]] = Progress(),
    session: Optional[Session] = None,
    stream: Optional[Stream] = None,
) -> tuple[Loader, OptState, list[tuple[int, float]], int, int]:
    """All epochs from ``start`` (a ``Progress``, or ``(epoch, batches done in it, step,
    samples seen)``). Returns (next loader, state, the (step, loss) pairs this call
    logged, steps, samples seen). ``session`` (the one ``train_loader`` runs in) hears
    every step; ``stream``: the loader as ``train_loader`` reads it (its restored
    position). ``opt`` must be the config's optimizer (the one the state belongs to)."""
    if opt != cfg.optimizer:
        raise ConfigError("run_loader_epochs: opt must be cfg.optimizer (the optimizer the state was made by)")
    if session is None:
        session = Session("train_loader", runner, cfg, "loader", log=log)
    if stream is None:
        stream = Stream(session.op, loader)
    start = start if isinstance(start, Progress) else Progress(*start)
    first_logged = len(session.logged)
    with runner.steady():  # checked at the first step, again after the user's code ran
        state, at = _epochs(cfg, stream, state, schedule_state, start, session)
    return stream.loader, state, session.logged[first_logged:], at.step, at.seen


def _epochs(cfg: LoaderTrainConfig, stream: Stream, state: OptState, schedule_state: ScheduleState,
            start: Progress, session: Session) -> tuple[OptState, Progress]:
    """The loop, top to bottom: per epoch the schedule, then per group of batches the
    update and what follows it (callbacks, checkpoints); stops at ``max_steps``."""
    op = session.op
    at, skip = start, start.batch
    event: Optional[StepEvent] = None
    while (cfg.epochs is None or at.epoch < cfg.epochs) and not _reached(cfg, at):
        if cfg.schedule_per == "epoch":
            state = schedule_state(at.epoch, state)  # the schedule advances once per epoch
        group: list[Sample] = []  # the items of up to cfg.accumulate loader batches
        b = skip - 1
        for b, raw in enumerate(stream.epoch(at.epoch, skip), start=skip):
            items = as_list_batch(op, raw)
            session.meter.saw(examples_in(raw, items))  # for the throughput: host shapes only
            group += cut(items, cfg.pieces)
            if (b + 1) % cfg.accumulate == 0:
                if at.step == start.step and session.reduction.ranks and not session.reduction.local:
                    warn_idle_ranks(op, group)  # the first update only (rank-local data: every rank has its own)
                state, at, event, stop = _group_update(cfg, session, stream, state, group, at, b, schedule_state)
                group = []
                if stop or _reached(cfg, at):
                    return state, at
        if group:  # the epoch's short tail group: its own mean
            state, at, event, stop = _group_update(cfg, session, stream, state, group, at, b, schedule_state)
            if stop or _reached(cfg, at):
                return state, at
        if b < 0:  # the pass yielded nothing
            if at.step == start.step:
                raise DataError(f"{op}: the loader yielded no batch in epoch {at.epoch}; nothing was trained")
            warnings.warn(f"{op}: the loader yielded no batch in epoch {at.epoch} (a stream that is read once?); "
                          f"training ends after {at.step} updates", stacklevel=3)
            return state, at
        if event is not None and session.end_epoch(event, at.epoch):
            return state, at
        skip = 0
        at = Progress(at.epoch + 1, 0, at.step, at.seen)
    return state, at


def cut(items: list[Sample], pieces: Optional[int]) -> list[Sample]:
    """The loader items cut into ``pieces`` along dimension 0 (``split_rows``), if asked."""
    return items if pieces is None else [p for s in items for p in split_rows(s, pieces)]


def warn_idle_ranks(op: str, group: list) -> None:
    """Under ``torch.distributed``, a loop whose first update has fewer items than ranks
    (a collated batch is one item) leaves ranks idle: say so once, with the remedy."""
    world = distributed.active()
    if world is not None and len(group) < world[1]:
        warnings.warn(f"{op}: an update has {len(group)} item(s) for {world[1]} ranks, so some ranks compute "
                      f"nothing (a collated batch is one item): pass pieces=N to cut each loader batch along "
                      f"dimension 0 into N items", stacklevel=4)


def _reached(cfg: LoaderTrainConfig, at: Progress) -> bool:
    return cfg.max_steps is not None and at.step >= cfg.max_steps


def _group_update(cfg: LoaderTrainConfig, session: Session, stream: Stream, state: OptState, group: list[Sample],
                  at: Progress, b: int, schedule_state: ScheduleState
                  ) -> tuple[OptState, Progress, StepEvent, bool]:
    """One update over a group of loader batches (the list-batch mean over its items),
    then the callbacks and the checkpoint cadence. Returns the new progress and stop."""
    if cfg.schedule_per == "step":
        state = schedule_state(at.step, state)  # indexed by update: a warm-up over updates
    state, loss = session.update(state, group, at.step)
    at = at.after(b + 1, len(group))
    event = session.event(at.step, state, loss, at.epoch, at.batch)
    return state, at, event, session.after_update(event, at.record(), stream.state)


def train_loader(
    runner: Runner, cfg: LoaderTrainConfig, loader: Loader, *, log: Log = print,
    callback: Optional[StepCallback] = None, callbacks: Sequence[Callback] = (),
) -> tuple[TrainReport, Loader]:
    """Train over a loader; returns the report and the loader to continue with.

    The loader is read lazily, one pass per epoch (``streams.py`` says how each kind
    resumes); one update per loader batch, or per ``cfg.accumulate`` batches.
    ``before``/``after`` are mean losses over up to ``cfg.measure_batches`` batches,
    measured where reading does not change what training reads (``None`` otherwise).

    Args:
        runner: the model, its loss and its slots.
        cfg: the loop's settings (epochs, ``max_steps``, optimizer, schedule and
            ``schedule_per``, checkpoints, features).
        loader: a ``DataLoader`` (seeded persistent shuffle; ``rank``/``world_size`` to
            read one rank's share), a ``torch.utils.data.DataLoader`` (a collated ``(x,
            y)`` batch or dict is one item), torchdata's ``StatefulDataLoader``, or any
            iterable of batches.
        log: called with each log line (``None``: no lines).
        callback: called with each ``StepEvent``; returning ``True`` stops the run.
        callbacks: ``Callback`` objects (loggers, early stopping, your own).

    Returns:
        ``(report, loader)``: the ``TrainReport`` and the loader to continue with (a
        ``DataLoader`` carries its advanced order; others are returned as given).

    Raises:
        ConfigError: a setting that does not fit, a loader made for another rank.
        DataError: a loader that yields nothing, a one-shot iterator with ``epochs > 1``,
            a malformed batch.
        CheckpointError: ``cfg.resume_from`` that does not fit this run (nothing changed).
    """
    op = "train_loader"
    check_inputs(op, runner, cfg, LoaderTrainConfig)
    if not isinstance(loader, (DataLoader, Iterable)):
        raise ConfigError(f"{op}: expected a DataLoader or an iterable of batches, got {type(loader).__name__}")
    if isinstance(loader, Iterator) and (cfg.epochs is None or cfg.epochs > 1):  # has __next__: walked once, then empty
        raise DataError(
            f"{op}: the loader is a one-shot iterator ({type(loader).__name__}: iter() returns itself), "
            f"read once, but epochs={cfg.epochs}; train it with epochs=1 (and max_steps), or pass a "
            f"re-iterable loader (a list of batches, a leantrain.DataLoader, a torch.utils.data.DataLoader)"
        )
    local = rank_local(op, loader, cfg.accumulate, cfg.pieces)  # each rank reads its own items (rank_data.py)
    stream = Stream(op, loader)
    with distributed.collectives(cfg.collective_timeout):  # fail, not hang, on a lost peer
        session = Session(op, runner, cfg, "loader", log=log, callback=callback, callbacks=callbacks, local=local)
        with session.computing():  # autocast and the loss scale, for this loop only
            partition = local and not isinstance(loader, DataLoader)  # a sampler's depends on the world size
            expect = {"n_samples": stream.size(), "accumulate": cfg.accumulate,
                      **({"world": distributed.rank_world()[1]} if partition else {})}
            state, ck = session.start(lambda: _measure(session, stream, cfg), expect,
                                      lambda manifest, tensors: stream.problems(loader_record(manifest, tensors))
                                      + stream.position_problems(manifest["progress"]))
            start = Progress()
            if ck is not None:
                p = ck.progress
                start = Progress(p["epoch"], p["batch"], p["step"], p["seen"])
                stream.restore(ck.loader_state, start.epoch, start.batch)
            session.begin(_total_steps(stream.loader, cfg), start.step)
            loader, state, _, steps, seen = run_loader_epochs(
                runner, cfg, stream.loader, cfg.optimizer, state, lambda t, s: s.with_lr(lr_for(cfg, t)),
                start=start, session=session, stream=stream,
            )
            if cfg.max_steps is not None and steps < cfg.max_steps and not session.stopped and cfg.epochs:
                warnings.warn(f"{op}: epochs={cfg.epochs} ended after {steps} updates, before max_steps="
                              f"{cfg.max_steps}; max_steps counts updates over the whole run, so raise epochs to "
                              f"reach it", stacklevel=2)
            return session.finish(lambda: _measure(session, stream, cfg), steps, seen), loader


def _measure(session: Session, stream: Stream, cfg: LoaderTrainConfig) -> Optional[float]:
    """The mean loss over one measuring pass (at most ``cfg.measure_batches`` batches),
    read batch by batch with the loader's generators put back afterwards; ``None``
    where a pass would change what training reads (a stream, a stateful loader)."""
    if not cfg.measure_loss or not stream.measurable():
        return None
    runner = session.runner
    with rng_preserved(runner.device, loader_generators(stream.loader)):
        return session.reduction.mean_loss(runner, stream.samples(cfg.measure_batches))  # rank-local: all ranks


def _total_steps(loader: Loader, cfg: LoaderTrainConfig) -> Optional[int]:
    """Updates in the whole run, when the loader knows its length (or ``max_steps`` bounds it)."""
    try:
        total = cfg.epochs * -(-len(loader) // cfg.accumulate)
    except TypeError:  # a loader without a length, or epochs=None
        return cfg.max_steps
    return total if cfg.max_steps is None else min(total, cfg.max_steps)
