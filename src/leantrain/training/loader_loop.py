"""The loader loop (seed: Runtime Supervised Training, spec §7.4): one averaged-gradient
update per loader batch.

The schedule advances once per epoch; the step counter (for logging) runs across
epochs. A checkpoint records the loader as it was at the start of the current epoch
plus the number of batches done, so a resume in the middle of an epoch replays the
same shuffle and skips what was done.
"""

from __future__ import annotations

import warnings
from typing import Iterable, Iterator, Optional, Sequence, Union

import torch

from ..data import DataLoader
from ..errors import ConfigError, DataError
from ..optim import OptState, Optimizer
from .batches import Loader, as_list_batch, fast_batches, loader_generators, loader_items, loader_size
from .config import LoaderTrainConfig, TrainReport, lr_for
from .runner import Runner, Sample
from .callbacks import Callback
from .events import StepCallback, StepEvent
from . import distributed
from .session import Log, ScheduleState, Session, check_inputs

def run_loader_epochs(
    runner: Runner,
    cfg: LoaderTrainConfig,
    loader: Loader,
    opt: Optimizer,
    state: OptState,
    schedule_state: ScheduleState,
    *,
    log: Log = print,
    start: tuple[int, int, int, int] = (0, 0, 0, 0),
    session: Optional[Session] = None,
) -> tuple[Loader, OptState, list[tuple[int, float]], int, int]:
    """All epochs from ``start = (epoch, batches done in it, step, samples seen)``.

    Returns (next loader, state, the (step, loss) pairs this call logged, steps,
    samples seen). ``session`` (the one ``train_loader`` runs in) hears every step."""
    if session is None:
        session = Session("train_loader", runner, cfg, "loader", log=log)
    with runner.steady():  # checked at the first step, again after the user's code ran
        return _epochs(cfg, loader, state, schedule_state, start, session)


def _epochs(cfg: LoaderTrainConfig, loader: Loader, state: OptState, schedule_state: ScheduleState,
            start: tuple[int, int, int, int], session: Session):
    op = "train_loader"
    first_logged = len(session.logged)
    epoch, skip, step, seen = start
    event: Optional[StepEvent] = None
    while epoch < cfg.epochs:
        epoch_loader = loader  # what a checkpoint taken in this epoch records
        if isinstance(loader, DataLoader):
            loader, batches = loader.epoch(op)
        else:
            batches = fast_batches(loader) or loader  # a TensorDataset: one gather per batch
        state = schedule_state(epoch, state)  # the schedule advances once per epoch
        group: list[Sample] = []  # the items of up to cfg.accumulate loader batches
        b = -1
        for b, raw in enumerate(batches):
            if b < skip:
                continue  # done before the checkpoint this run resumed from (a group boundary)
            group += as_list_batch(op, raw)
            if (b + 1) % cfg.accumulate == 0:
                state, step, seen, event, stop = _group_update(session, state, group, step, seen, epoch, b,
                                                               epoch_loader)
                group = []
                if stop:
                    return loader, state, session.logged[first_logged:], step, seen
        if group:  # the epoch's short tail group: its own mean
            state, step, seen, event, stop = _group_update(session, state, group, step, seen, epoch, b, epoch_loader)
            if stop:
                return loader, state, session.logged[first_logged:], step, seen
        if event is not None and session.end_epoch(event, epoch):
            return loader, state, session.logged[first_logged:], step, seen
        skip = 0
        epoch += 1
    return loader, state, session.logged[first_logged:], step, seen


def train_loader(
    runner: Runner, cfg: LoaderTrainConfig, loader: Loader, *, log: Log = print,
    callback: Optional[StepCallback] = None, callbacks: Sequence[Callback] = (),
) -> tuple[TrainReport, Loader]:
    """Train over a loader; returns the report and the loader to continue with.

    ``loader`` is a ``DataLoader`` (seeded persistent shuffle; keep the returned one
    to continue the sequence) or any re-iterable of batches, such as a
    ``torch.utils.data.DataLoader`` (a collated ``(x, y)`` batch is one vectorised
    item). ``before``/``after`` are mean losses over the loader's items. Exact resume
    needs a ``DataLoader``: another iterable is resumed by skipping the batches done.
    """
    op = "train_loader"
    check_inputs(op, runner, cfg, LoaderTrainConfig)
    if not isinstance(loader, (DataLoader, Iterable)):
        raise ConfigError(f"{op}: expected a DataLoader or an iterable of batches, got {type(loader).__name__}")
    if isinstance(loader, Iterator):  # has __next__: walked once, then empty
        raise DataError(
            f"{op}: the loader is a one-shot iterator ({type(loader).__name__}: iter() returns itself), "
            f"but training walks it once per epoch and for the before/after losses; pass a list of "
            f"batches, a leantrain.DataLoader or a torch.utils.data.DataLoader"
        )
    with distributed.collectives(cfg.collective_timeout):  # fail, not hang, on a lost peer
        session = Session(op, runner, cfg, "loader", log=log, callback=callback, callbacks=callbacks)
        with session.computing():  # autocast and the loss scale, for this loop only
            # The items are read only for the before/after losses; their count is known anyway.
            items = loader_items(op, loader, runner.device) if cfg.measure_loss else None
            n = len(items) if items is not None else loader_size(op, loader, runner.device)
            state, ck = session.start(items or [], {"n_samples": n, "accumulate": cfg.accumulate},
                                      _loader_check(op, loader))
            start = (0, 0, 0, 0)
            if ck is not None:
                p = ck.progress
                if isinstance(loader, DataLoader):
                    if ck.loader_state is None:
                        raise DataError(f"{op}: {session.resume_from}: the checkpoint has no loader state")
                    loader = loader.restored(ck.loader_state, op)
                start = (p["epoch"], p["batch"], p["step"], p["seen"])
                _warn_unseeded(loader)
            session.begin(_total_steps(loader, cfg.epochs, cfg.accumulate), start[2])
            loader, state, _, steps, seen = run_loader_epochs(
                runner, cfg, loader, cfg.optimizer, state, lambda t, s: s.with_lr(lr_for(cfg, t)),
                start=start, session=session,
            )
            after_items = loader_items(op, loader, runner.device) if cfg.measure_loss else []
            return session.finish(after_items, steps, seen), loader


def _group_update(session: Session, state: OptState, group: list[Sample], step: int, seen: int,
                  epoch: int, b: int, epoch_loader: Loader) -> tuple[OptState, int, int, StepEvent, bool]:
    """One update over a group of loader batches (the list-batch mean over its items),
    then the callbacks and the checkpoint cadence. Returns the new counters and stop."""
    state, loss = session.update(state, group, step)
    step, seen = step + 1, seen + len(group)
    event = StepEvent(step, state, loss, epoch, b + 1, grad_norm=session.last_norm)
    progress = {"epoch": epoch, "batch": b + 1, "seen": seen}
    lstate = epoch_loader.state() if isinstance(epoch_loader, DataLoader) else None
    return state, step, seen, event, session.after_update(event, progress, lstate)


def _total_steps(loader: Loader, epochs: int, accumulate: int = 1) -> Optional[int]:
    """Updates in the whole run, when the loader knows its length."""
    try:
        return epochs * -(-len(loader) // accumulate)
    except TypeError:
        return None


def _warn_unseeded(loader: Loader) -> None:
    """A resumed torch DataLoader that shuffles without a seeded generator draws other
    orders than the interrupted run: say so, once per resume."""
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, torch.utils.data.RandomSampler) and not loader_generators(loader):
        warnings.warn(
            "train_loader: resuming with a shuffled torch DataLoader that has no seeded generator: "
            "the remaining batches will not be the ones the interrupted run would have seen; "
            "pass generator=torch.Generator().manual_seed(SEED) to the DataLoader for an exact resume",
            stacklevel=3,
        )


def _loader_check(op: str, loader: Loader):
    """For a resume: the saved loader state must fit ``loader`` (checked before install)."""
    if not isinstance(loader, DataLoader):
        return None

    def check(manifest: dict, tensors: dict) -> list[str]:
        saved = manifest.get("loader")
        if not isinstance(saved, dict) or "loader.order" not in tensors:
            return ["the checkpoint has no loader state"]
        try:
            loader.restored(dict(saved, order=tensors["loader.order"].tolist()), op)
        except DataError as e:
            return [str(e).removeprefix(f"{op}: ")]
        return []

    return check
