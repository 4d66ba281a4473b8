"""The loader loop (seed: Runtime Supervised Training, spec §7.4): one averaged-gradient
update per loader batch.

The schedule advances once per epoch; the step counter (for logging) runs across
epochs. A checkpoint records the loader as it was at the start of the current epoch
plus the number of batches done, so a resume in the middle of an epoch replays the
same shuffle and skips what was done.
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import torch

from ..data import DataLoader
from ..errors import ConfigError, DataError
from ..optim import OptState, Optimizer
from .binding import rng_preserved
from .config import LoaderTrainConfig, TrainReport, lr_for
from .runner import Runner, Sample
from .session import Callback, Log, ScheduleState, Session, StepEvent, check_inputs

Loader = Union[DataLoader, Iterable]


def as_list_batch(op: str, batch: object) -> list[Sample]:
    """A loader batch: a list of samples, or one collated ``(x, y)`` pair (a list of one)."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and all(
        isinstance(t, torch.Tensor) for t in batch
    ):
        return [(batch[0], batch[1])]
    if isinstance(batch, (tuple, list)):
        return list(batch)
    raise DataError(
        f"{op}: a loader batch must be a list of (x, y) samples or one (x, y) pair of "
        f"tensors, got {type(batch).__name__}"
    )


def loader_generators(loader: object) -> list[torch.Generator]:
    """The generators iterating ``loader`` draws from (a torch DataLoader's own, its
    sampler's, its batch sampler's sampler's), each once."""
    found: dict[int, torch.Generator] = {}
    sampler = getattr(loader, "sampler", None)
    inner = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    for owner in (loader, sampler, inner):
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator):
            found.setdefault(id(g), g)
    return list(found.values())


def loader_items(op: str, loader: Loader, device: torch.device) -> list[Sample]:
    """Every item of one pass over ``loader``, read without consuming its randomness:
    a shuffled torch DataLoader then yields the same epochs as in the user's own loop."""
    if isinstance(loader, DataLoader):
        items = loader.items(op)
    else:
        with rng_preserved(device, loader_generators(loader)):
            items = [s for raw in loader for s in as_list_batch(op, raw)]
    if not items:
        raise DataError(f"{op}: empty dataset")
    return items


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
    op = "train_loader"
    if session is None:
        session = Session(op, runner, cfg, "loader", log=log)
    first_logged = len(session.logged)
    epoch, skip, step, seen = start
    while epoch < cfg.epochs:
        epoch_loader = loader  # what a checkpoint taken in this epoch records
        if isinstance(loader, DataLoader):
            loader, batches = loader.epoch(op)
        else:
            batches = loader
        state = schedule_state(epoch, state)  # the schedule advances once per epoch
        for b, raw in enumerate(batches):
            if b < skip:
                continue  # done before the checkpoint this run resumed from
            batch = as_list_batch(op, raw)
            state, loss = session.update(state, batch, step)
            step += 1
            seen += len(batch)
            progress = {"epoch": epoch, "batch": b + 1, "seen": seen}
            lstate = epoch_loader.state() if isinstance(epoch_loader, DataLoader) else None
            if session.after_update(StepEvent(step, state, loss, epoch, b + 1), progress, lstate):
                return loader, state, session.logged[first_logged:], step, seen
        skip = 0
        epoch += 1
    return loader, state, session.logged[first_logged:], step, seen


def train_loader(
    runner: Runner, cfg: LoaderTrainConfig, loader: Loader, *, log: Log = print,
    callback: Optional[Callback] = None,
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
    session = Session(op, runner, cfg, "loader", log=log, callback=callback)
    items = loader_items(op, loader, runner.device)
    state, ck = session.start(items, {"n_samples": len(items)})
    start = (0, 0, 0, 0)
    if ck is not None:
        p = ck.progress
        if isinstance(loader, DataLoader):
            if ck.loader_state is None:
                raise DataError(f"{op}: {cfg.resume_from}: the checkpoint has no loader state")
            loader = loader.restored(ck.loader_state, op)
        start = (p["epoch"], p["batch"], p["step"], p["seen"])
    loader, state, _, steps, seen = run_loader_epochs(
        runner, cfg, loader, cfg.optimizer, state, lambda t, s: s.with_lr(lr_for(cfg, t)),
        start=start, session=session,
    )
    return session.finish(loader_items(op, loader, runner.device), steps, seen), loader
