"""Loader training (spec §7.4): one averaged-gradient update per loader batch.

The schedule advances once per epoch; the step counter (for logging) runs across
epochs. A checkpoint records the loader as it was at the start of the current
epoch plus the number of batches done, so a resume in the middle of an epoch
replays the same shuffle and skips what was done.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Optional, Union

import torch

from ..io.checkpoint import save_checkpoint
from .config import LoaderTrainConfig, TrainReport, lr_for
from .binding import rng_preserved
from ..data import DataLoader
from ..errors import ConfigError, DataError
from ..optim import OptState, Optimizer
from .runner import Runner, Sample
from . import distributed
from .loops import (
    Callback, Log, ScheduleState, StepEvent, _check_inputs, _main_only, _one_update, _resume,
    skip_counter, skipped_total, uses_native,
)

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
    on_step: Optional[Callable[..., Optional[bool]]] = None,
    skipped: Optional[torch.Tensor] = None,
) -> tuple[Loader, OptState, list[tuple[int, float]], int, int]:
    """All epochs from ``start = (epoch, batches done in it, step, samples seen)``.

    Returns (next loader, state, logged (step, loss) pairs, steps, samples seen).
    ``on_step(step, epoch, batch, epoch_loader, state, loss, seen)`` runs after each
    update; a true result stops the loop.
    """
    op = "train_loader"
    native = state.path == "native"
    logged: list[tuple[int, float]] = []
    epoch, skip, step, seen = start
    while epoch < cfg.epochs:
        epoch_loader = loader
        if isinstance(loader, DataLoader):
            loader, batches = loader.epoch(op)
        else:
            batches = loader
        state = schedule_state(epoch, state)  # the schedule advances once per epoch
        for b, raw in enumerate(batches):
            if b < skip:
                continue  # done before the checkpoint this run resumed from
            batch = as_list_batch(op, raw)
            state, loss = _one_update(runner, cfg, opt, state, native, batch, step, log, logged, skipped)
            step += 1
            seen += len(batch)
            if on_step is not None and on_step(step, epoch, b + 1, epoch_loader, state, loss, seen):
                return loader, state, logged, step, seen
        skip = 0
        epoch += 1
    return loader, state, logged, step, seen


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


def _loader_items(op: str, loader: Loader, device: torch.device) -> list[Sample]:
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
    _check_inputs(op, runner, cfg, LoaderTrainConfig)
    if not isinstance(loader, (DataLoader, Iterable)):
        raise ConfigError(f"{op}: expected a DataLoader or an iterable of batches, got {type(loader).__name__}")
    start_time = time.perf_counter()
    opt = cfg.optimizer
    runner.train()
    log, main = _main_only(log)
    items = _loader_items(op, loader, runner.device)
    if cfg.resume_from is not None:
        ck = _resume(op, cfg, runner, opt, "loader", {"n_samples": len(items)})
        p, state = ck.progress, ck.state
        if isinstance(loader, DataLoader):
            if ck.loader_state is None:
                raise DataError(f"{op}: {cfg.resume_from}: the checkpoint has no loader state")
            loader = loader.restored(ck.loader_state, op)
        before, logged = p["before"], [tuple(x) for x in p["losses"]]
        start = (p["epoch"], p["batch"], p["step"], p["seen"])
        distributed.start_replicas(runner, cfg.replica_check)
    else:
        distributed.start_replicas(runner, cfg.replica_check)
        before, logged, start = runner.mean_loss(items), [], (0, 0, 0, 0)
        state = opt.init(runner.params, native=uses_native(runner, opt))
    new_logged: list = []

    def save(step, epoch, batch, epoch_loader, state, seen) -> None:
        if not main:
            return  # rank 0 writes the checkpoints
        progress = {"kind": "loader", "epoch": epoch, "batch": batch, "step": step, "seen": seen,
                    "n_samples": len(items), "before": before, "losses": logged + new_logged}
        lstate = epoch_loader.state() if isinstance(epoch_loader, DataLoader) else None
        save_checkpoint(cfg.checkpoint_path, runner, state=state, progress=progress, loader_state=lstate)

    last: dict = {}

    def on_step(step, epoch, batch, epoch_loader, state, loss, seen) -> bool:
        if loss is not None:
            new_logged.append((step - 1, loss))
        stop = bool(callback and callback(StepEvent(step, state, loss, epoch, batch)))
        last.update(args=(step, epoch, batch, epoch_loader, state, seen), stopped=stop)
        if cfg.checkpoint_path and (stop or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)):
            save(*last["args"])
            last["saved"] = step
        return stop

    skipped = skip_counter(runner, cfg)
    loader, state, _, steps, seen = run_loader_epochs(
        runner, cfg, loader, opt, state, lambda t, s: s.with_lr(lr_for(cfg, t)),
        log=log, start=start, on_step=on_step, skipped=skipped,
    )
    if cfg.checkpoint_path and "args" in last and last.get("saved") != steps:
        save(*last["args"])
    after = runner.mean_loss(_loader_items(op, loader, runner.device))
    runner.sync()  # intentional, once: the module shows the trained values
    report = TrainReport(
        before, after, steps, seen, tuple(logged + new_logged), time.perf_counter() - start_time,
        interrupted=last.get("stopped", False), skipped_steps=skipped_total(skipped),
    )
    return report, loader
