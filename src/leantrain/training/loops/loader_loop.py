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

import dataclasses
import itertools
import math
import warnings
from typing import Iterable, Iterator, Optional, Sequence, Union

import torch

from ...collate import single_row
from ...data import DataLoader
from ...errors import ConfigError, DataError
from ...optim import OptState, Optimizer
from .batches import Loader, as_list_batch, examples_in, loader_generators
from ..runner.binding import rng_preserved
from .config import LoaderTrainConfig, TrainReport, epoch_schedule_varies, scheduled
from .evaluation import batch_count
from ..runner.runner import Runner, Sample
from ...samples import split_rows
from .callbacks import Callback
from .events import Progress, StepCallback
from ..parallel import distributed
from .loop_checks import check_inputs
from ..parallel.rank_data import rank_local
from .session import Log, ScheduleState, Session
from .loader_kinds import stream_of
from .streams import Stream
from ...io.loading import loader_record

def run_loader_epochs(
    runner: Runner,
    cfg: LoaderTrainConfig,
    loader: Loader,
    opt: Optimizer,
    state: OptState,
    schedule_state: ScheduleState,
    *,
    log: Log = print,
    start: Union[Progress, tuple[int, int, int, int]] = Progress(0, 0, 0, 0),
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
        stream = stream_of(session.op, loader)
    if not isinstance(start, Progress):  # (epoch, batches done in it, step, samples seen)
        epoch, batch, step, seen = start
        start = Progress(step, epoch, batch, seen)
    first_logged = len(session.record.logged)
    with runner.steady():  # checked at the first step, again after the user's code ran
        state, at = _epochs(cfg, stream, state, schedule_state, start, session)
    return stream.loader, state, session.record.logged[first_logged:], at.step, at.seen


def _epochs(cfg: LoaderTrainConfig, stream: Stream, state: OptState, schedule_state: ScheduleState,
            start: Progress, session: Session) -> tuple[OptState, Progress]:
    """The loop, top to bottom: per epoch the schedule, then per group of batches the
    update and what follows it (callbacks, checkpoints), then the epoch's end; stops at
    ``max_steps``, when asked to, or when the loader runs dry."""
    at = start
    while (cfg.epochs is None or at.epoch < cfg.epochs) and not _reached(cfg, at):
        state, at, stop = _epoch(cfg, stream, state, schedule_state, at, start, session)
        if stop:
            break
        at = at.next_epoch()
    return state, at


def _epoch(cfg: LoaderTrainConfig, stream: Stream, state: OptState, schedule_state: ScheduleState, at: Progress,
           start: Progress, session: Session) -> tuple[OptState, Progress, bool]:
    """One epoch from ``at`` (a resumed one after the batches it did): its updates and its
    end. Returns the state, where the run stands and whether the run stops."""
    op = session.op
    if cfg.schedule_per == "epoch":
        state = schedule_state(at.epoch, state)  # the schedule advances once per epoch
    read, stop = at.batch, False  # loader batches of this epoch read so far
    for group, read in _groups(op, stream, at, cfg, session):
        if at.step == start.step and session.reduction.ranks and not session.reduction.local:
            warn_idle_ranks(op, group)  # the first update only (rank-local data: every rank has its own)
        if cfg.schedule_per == "step":
            state = schedule_state(at.step, state)  # indexed by update: a warm-up over updates
        done = session.update(state, group, at.step + 1)
        state, at = done.state, at.after(read, len(group))
        stop = session.after_update(done, group, at, stream.state) or _reached(cfg, at)
        if stop:
            break
    else:
        stop = _epoch_end(op, read, at, start, state, session, stream)
    return state, at, stop


def _epoch_end(op: str, read: int, at: Progress, start: Progress, state: OptState, session: Session,
               stream: Stream) -> bool:
    """The end of a pass: the session's epoch end (also when a resumed run starts at
    an epoch's last batch, whose end the interrupted run had not reached), or, when the
    pass yielded nothing, the end of training. True: stop."""
    if read:
        return session.end_epoch(at, state, stream.state)
    if at.step == start.step:
        raise DataError(f"{op}: the loader yielded no batch in epoch {at.epoch}; nothing was trained")
    warnings.warn(f"{op}: the loader yielded no batch in epoch {at.epoch} (a stream that is read once?); "
                  f"training ends after {at.step} updates", stacklevel=5)
    return True


def _groups(op: str, stream: Stream, at: Progress, cfg: LoaderTrainConfig, session: Session):
    """An epoch's updates: (the items of up to ``cfg.accumulate`` loader batches, the
    epoch's batches read after them); an epoch's short tail group is its own. A resumed
    epoch continues after the ``at.batch`` batches done, its groups where the interrupted
    run's were."""
    group: list[Sample] = []
    read = at.batch
    batches = stream.epoch(at.epoch, at.batch)
    if stream.limit is not None:  # limit_train_batches: the epoch ends after its first ``limit`` batches
        batches = itertools.islice(batches, max(0, stream.limit - at.batch))
    for raw in _batches(op, batches, session):
        read += 1
        items = as_list_batch(op, raw)
        session.meter.saw(examples_in(raw, items))  # for the throughput: host shapes only
        group += cut(items, cfg.pieces)
        if read % cfg.accumulate_at(at.epoch) == 0:
            yield group, read
            group = []
    if group:
        yield group, read


def _batches(op: str, batches: Iterator, session: Session) -> Iterator:
    """The loader's batches as they come; a worker process that died is named as such (a
    ``DataError`` with the last good checkpoint), not torch's bare ``RuntimeError``."""
    while True:
        try:
            raw = next(batches)
        except StopIteration:
            return
        except RuntimeError as e:
            if not str(e).startswith("DataLoader worker"):
                raise
            raise DataError(f"{op}: a loader worker process died ({str(e).splitlines()[0]}); last good "
                            f"checkpoint: {session.checkpoints.last()}") from e
        yield raw


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


def train_loader(
    runner: Runner, cfg: LoaderTrainConfig, loader: Loader, *, log: Log = print,
    callback: Optional[StepCallback] = None, callbacks: Sequence[Callback] = (),
) -> tuple[TrainReport, Loader]:
    """Train over a loader; returns the report and the loader to continue with.

    The loader is read lazily, one pass per epoch (``streams.py`` says how each kind
    resumes); one update per loader batch, or per ``cfg.accumulate`` batches.
    ``before``/``after`` are mean losses over the first ``cfg.measure_batches`` batches
    of a measuring pass (default 1; ``None``: the whole pass), at the first and the final
    weights, measured where reading does not change what training reads (``None``
    otherwise).

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
    row_by_row_hint(op, loader)
    local = rank_local(op, loader, cfg.accumulate_at(0), cfg.pieces)  # each rank reads its own items (rank_data.py)
    stream = stream_of(op, loader)
    stream.limit = batch_count(op, loader, cfg.limit_train_batches, "limit_train_batches")
    if isinstance(cfg.epochs, float):
        cfg = fractional_epochs(op, cfg, loader, stream.limit)
    if cfg.schedule_per == "epoch" and cfg.epochs is None and epoch_schedule_varies(cfg.scheduler) \
            and stream.size() is None:
        warnings.warn(f"{op}: schedule_per='epoch' with a loader that has no length and epochs=None: the schedule "
                      f"advances only when a pass of the loader ends, so a stream that never ends trains at the "
                      f"rate {cfg.scheduler.lr_at(0)!r} throughout; set schedule_per='step' to schedule over "
                      f"updates", stacklevel=2)
    with distributed.collectives(cfg.parallel.collective_timeout):  # fail, not hang, on a lost peer
        session = Session(op, runner, cfg, "loader", log=log, callback=callback, callbacks=callbacks, local=local)
        with session.computing():  # autocast and the loss scale, for this loop only
            partition = local and not isinstance(loader, DataLoader)  # a sampler's depends on the world size
            expect = {"n_samples": stream.size(), "accumulate": cfg.accumulate_record(),
                      "limit_train_batches": cfg.limit_train_batches,
                      **({"world": distributed.rank_world()[1]} if partition else {})}
            state, ck = session.start(lambda: _measure(session, stream, cfg), expect,
                                      lambda manifest, tensors: stream.problems(loader_record(manifest, tensors))
                                      + stream.position_problems(manifest["progress"])
                                      + _epoch_problems(manifest["progress"], cfg))
            start = Progress(0, 0, 0, 0)
            if ck is not None:
                p = ck.progress
                start = Progress(p["step"], p["epoch"], p["batch"], p["seen"])
                stream.restore(ck.loader_state, start.epoch, start.batch)
            session.begin(_total_steps(stream.loader, cfg, stream.limit), start.step)
            loader, state, _, steps, seen = run_loader_epochs(
                runner, cfg, stream.loader, cfg.optimizer, state, scheduled(cfg),
                start=start, session=session, stream=stream,
            )
            if cfg.max_steps is not None and steps < cfg.max_steps and not session.stopped and cfg.epochs:
                warnings.warn(f"{op}: epochs={cfg.epochs} ended after {steps} updates, before max_steps="
                              f"{cfg.max_steps}; max_steps counts updates over the whole run, so raise epochs to "
                              f"reach it", stacklevel=2)
            return session.finish(lambda: _measure(session, stream, cfg), steps, seen), loader


def row_by_row_hint(op: str, loader) -> None:
    """Said once at the point of use (by rank 0, as the run's other words): an in-memory
    ``DataLoader`` without a collate whose items are single rows trains each row as its own
    item (a forward and a backward each), where a torch user means a minibatch. Nothing is
    read for it: the first stored item."""
    if not (isinstance(loader, DataLoader) and loader.collate is None and loader.batch_size > 1 and not loader.lazy
            and len(loader.dataset) and single_row(loader.dataset.samples[0]) and distributed.is_main()):
        return
    first = loader.dataset.samples[0]
    shape = tuple((first[0] if not isinstance(first, dict) else next(
        v for v in first.values() if isinstance(v, torch.Tensor))).shape)
    warnings.warn(f"{op}: the DataLoader has no collate and its items are single rows (the first's input shaped "
                  f"{shape}): each of a batch's {loader.batch_size} rows is its own item, with a forward and a "
                  f"backward of its own ({loader.batch_size} per update, the accumulation contract). For "
                  f"minibatches pass collate=leantrain.collate.stack (rows stacked into one item); to train row "
                  f"by row, say so with collate=leantrain.collate.items", stacklevel=3)


def _epoch_problems(progress: dict, cfg: LoaderTrainConfig) -> list[str]:
    """A checkpoint in an epoch past this run's ``epochs`` would end the run at once."""
    e = progress.get("epoch")
    if cfg.epochs is not None and isinstance(e, int) and not isinstance(e, bool) and e >= cfg.epochs:
        return [f"progress.epoch: the checkpoint is in epoch {e + 1} (from 1), past this run's epochs={cfg.epochs}; "
                f"resume it with epochs >= {e + 1}"]
    return []


def _measure(session: Session, stream: Stream, cfg: LoaderTrainConfig) -> Optional[float]:
    """The mean loss over one measuring pass (at most ``cfg.measure_batches`` batches),
    read batch by batch with the loader's generators put back afterwards; ``None``
    where a pass would change what training reads (a stream, a stateful loader)."""
    if not cfg.measure_loss or not stream.measurable():
        return None
    runner = session.runner
    with rng_preserved(runner.device, loader_generators(stream.loader)):
        return session.strategy.mean_loss(runner, stream.samples(cfg.measure_batches))  # rank-local: all ranks


def fractional_epochs(op: str, cfg: LoaderTrainConfig, loader: Loader, limit: Optional[int]) -> LoaderTrainConfig:
    """A fractional ``epochs`` as the run trains it (Trainer's ``num_train_epochs=1.5``): its
    whole epochs, then that fraction of the next epoch's updates rounded up, as
    ``max_steps`` (the user's own ``max_steps`` if smaller), over ``ceil(epochs)`` passes."""
    try:
        n = len(loader) if limit is None else min(len(loader), limit)
    except TypeError:
        raise ConfigError(f"{op}: epochs={cfg.epochs} counts a fraction of an epoch's updates, but the loader has no "
                          f"length: give a whole number of epochs and max_steps") from None
    whole = int(cfg.epochs)
    updates = sum(-(-n // cfg.accumulate_at(e)) for e in range(whole))
    updates += math.ceil((cfg.epochs - whole) * -(-n // cfg.accumulate_at(whole)))
    cap = updates if cfg.max_steps is None else min(updates, cfg.max_steps)
    return dataclasses.replace(cfg, epochs=math.ceil(cfg.epochs), max_steps=cap)


def _total_steps(loader: Loader, cfg: LoaderTrainConfig, limit: Optional[int] = None) -> Optional[int]:
    """Updates in the whole run, when the loader knows its length (or ``max_steps`` bounds it)."""
    try:
        n = len(loader) if limit is None else min(len(loader), limit)
        total = sum(-(-n // cfg.accumulate_at(e)) for e in range(cfg.epochs))
    except TypeError:  # a loader without a length, or epochs=None
        return cfg.max_steps
    return total if cfg.max_steps is None else min(total, cfg.max_steps)
