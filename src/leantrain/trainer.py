"""The supervised loops (seed: Runtime Supervised Training, spec §7.3-§7.4).

Each loop reads top to bottom: fetch, schedule, update (with the loss only when a
log line is due), log, watch memory. Nothing is read back to the host between log
points.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Optional, Sequence, Union

import torch

from .config import LoaderTrainConfig, TrainConfig, lr_for
from .data import DataLoader, Dataset
from .errors import ConfigError, DataError
from .memory import MemoryWatch, cadence
from .optim import OptState, Optimizer
from .runner import Runner, Sample, check_sample
from .steps import step_batch, step_batch_and_loss

Log = Callable[[str], None]
ScheduleState = Callable[[int, OptState], OptState]


def _check_config(op: str, cfg: object, kind: type) -> None:
    if not isinstance(cfg, kind):
        raise ConfigError(f"{op}: expected a {kind.__name__}, got {type(cfg).__name__}")


def _check_runner(op: str, runner: object) -> None:
    if not isinstance(runner, Runner):
        raise ConfigError(f"{op}: expected a Runner, got {type(runner).__name__}")


def log_line(step: int, loss: float) -> str:
    return f"step {step}: loss={loss:.6f}"


def cyclic_batches(op: str, samples: Sequence[Sample], k: int, cursor: int = 0):
    """``k`` samples per call, continuing where the last call stopped and wrapping."""
    if not samples:
        raise DataError(f"{op}: empty sample cycle")
    n = len(samples)
    while True:
        batch = [samples[(cursor + j) % n] for j in range(k)]
        cursor = (cursor + k) % n
        yield batch


def uses_native(runner: Runner, opt: Optimizer) -> bool:
    """The loop's path, decided once: native when the optimizer has one and the
    parameters live on device mirrors; never switched mid-run (not even for a short
    last batch), so one history stays on one path."""
    return opt.native and runner.params.has_mirrors()


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
    on_step: Optional[Callable[[int, OptState], None]] = None,
) -> tuple[OptState, list[tuple[int, float]]]:
    """The fixed-step loop; returns the final state and the logged ``(step, loss)`` pairs."""
    native = state.path == "native"
    logged: list[tuple[int, float]] = []
    for step in range(start_step, cfg.steps):
        batch = next_batch()
        state = schedule_state(step, state)  # the schedule advances per optimizer step
        if cfg.log_every and step % cfg.log_every == 0:
            state, loss = step_batch_and_loss(
                runner, opt, state, native, batch, accumulation=cfg.accumulation
            )
            logged.append((step, loss))
            log(log_line(step, loss))
        else:
            state = step_batch(runner, opt, state, native, batch, accumulation=cfg.accumulation)
        watch_memory(step + 1)
        if on_step is not None:
            on_step(step + 1, state)
    return state, logged


def train_samples(
    runner: Runner, cfg: TrainConfig, samples: Sequence[Sample], *, log: Log = print
) -> "TrainReport":
    """Train on an in-memory list for ``cfg.steps`` updates of ``cfg.batch_size`` items.

    Items are taken cyclically in stored order (never shuffled); a batch may wrap
    around the end. The runner keeps the trained parameters and stays in train mode.
    """
    from .config import TrainReport

    op = "train_samples"
    _check_runner(op, runner)
    _check_config(op, cfg, TrainConfig)
    if len(samples) == 0:
        raise DataError(f"{op}: empty sample list; nothing to train on")
    samples = [check_sample(op, s, i) for i, s in enumerate(samples)]
    start = time.perf_counter()
    runner.train()
    before = runner.mean_loss(samples)
    watch = MemoryWatch(cadence(cfg.mem_watch, cfg.steps, runner.device), cfg.steps, runner.device, log)
    watch(0)
    opt = cfg.optimizer
    state = opt.init(runner.params, native=uses_native(runner, opt))
    batches = cyclic_batches(op, samples, cfg.batch_size)
    state, logged = run_sample_steps(
        runner,
        cfg,
        lambda: next(batches),
        watch,
        opt,
        state,
        lambda t, s: s.with_lr(lr_for(cfg, t)),
        log=log,
    )
    after = runner.mean_loss(samples)
    return TrainReport(
        before, after, cfg.steps, cfg.steps * cfg.batch_size, tuple(logged),
        time.perf_counter() - start,
    )


def train_dataset(
    runner: Runner, cfg: TrainConfig, dataset: Dataset, *, log: Log = print
) -> "TrainReport":
    """``train_samples`` over the dataset's items in stored order."""
    if not isinstance(dataset, Dataset):
        raise ConfigError(f"train_dataset: expected a Dataset, got {type(dataset).__name__}")
    return train_samples(runner, cfg, dataset.to_list(), log=log)


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
    loader: Union[DataLoader, Iterable],
    opt: Optimizer,
    state: OptState,
    schedule_state: ScheduleState,
    *,
    log: Log = print,
) -> tuple[Union[DataLoader, Iterable], OptState, list[tuple[int, float]], int, int]:
    """All epochs; returns (next loader, state, logged losses, steps, samples seen)."""
    op = "train_loader"
    native = state.path == "native"
    logged: list[tuple[int, float]] = []
    step = seen = 0
    for epoch in range(cfg.epochs):
        if isinstance(loader, DataLoader):
            loader, batches = loader.epoch(op)
        else:
            batches = loader
        state = schedule_state(epoch, state)  # the schedule advances once per epoch
        for raw in batches:
            batch = as_list_batch(op, raw)
            if cfg.log_every and step % cfg.log_every == 0:
                state, loss = step_batch_and_loss(
                    runner, opt, state, native, batch, accumulation=cfg.accumulation
                )
                logged.append((step, loss))
                log(log_line(step, loss))
            else:
                state = step_batch(runner, opt, state, native, batch, accumulation=cfg.accumulation)
            step += 1
            seen += len(batch)
    return loader, state, logged, step, seen


def _loader_items(op: str, loader) -> list[Sample]:
    if isinstance(loader, DataLoader):
        items = loader.dataset.to_list()
    else:
        items = [s for raw in loader for s in as_list_batch(op, raw)]
    if not items:
        raise DataError(f"{op}: empty dataset")
    return items


def train_loader(
    runner: Runner, cfg: LoaderTrainConfig, loader: Union[DataLoader, Iterable], *, log: Log = print
) -> tuple["TrainReport", Union[DataLoader, Iterable]]:
    """Train over a loader; returns the report and the loader to continue with.

    ``loader`` is a ``DataLoader`` (seeded persistent shuffle; keep the returned one
    to continue the sequence) or any re-iterable of batches, such as a
    ``torch.utils.data.DataLoader`` (a collated ``(x, y)`` batch is one vectorised
    item). ``before``/``after`` are mean losses over the loader's items.
    """
    from .config import TrainReport

    op = "train_loader"
    _check_runner(op, runner)
    _check_config(op, cfg, LoaderTrainConfig)
    if not isinstance(loader, DataLoader) and not isinstance(loader, Iterable):
        raise ConfigError(f"{op}: expected a DataLoader or an iterable of batches, got {type(loader).__name__}")
    start = time.perf_counter()
    runner.train()
    before = runner.mean_loss(_loader_items(op, loader))
    opt = cfg.optimizer
    state = opt.init(runner.params, native=uses_native(runner, opt))
    loader, state, logged, steps, seen = run_loader_epochs(
        runner, cfg, loader, opt, state, lambda t, s: s.with_lr(lr_for(cfg, t)), log=log
    )
    after = runner.mean_loss(_loader_items(op, loader))
    report = TrainReport(before, after, steps, seen, tuple(logged), time.perf_counter() - start)
    return report, loader
