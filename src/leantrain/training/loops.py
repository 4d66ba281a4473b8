"""The supervised loops (seed: Runtime Supervised Training, spec §7.3-§7.4).

Each loop reads top to bottom: fetch, schedule, update (with the loss only when a
log line is due), log, watch memory, checkpoint. Nothing is read back to the host
between log points. ``checkpoint_path``/``checkpoint_every``/``resume_from`` in the
configs make a run save itself and continue exactly (see ``checkpoint.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from . import distributed
from ..io.checkpoint import load_checkpoint, save_checkpoint
from .config import TrainConfig, TrainReport, lr_for
from ..data import Dataset
from ..errors import CheckpointError, ConfigError, DataError, NonFiniteError
from .memory import MemoryWatch, cadence
from ..optim import OptState, Optimizer
from .runner import Runner, Sample, check_sample
from .step import step_batch, step_batch_and_loss

Log = Callable[[str], None]
ScheduleState = Callable[[int, OptState], OptState]


@dataclass(frozen=True)
class StepEvent:
    """What a callback sees after each update. ``loss`` is set on logged steps only."""

    step: int  # updates completed so far
    state: OptState
    loss: Optional[float] = None
    epoch: Optional[int] = None
    batch: Optional[int] = None  # batches completed in this epoch (loaders)


# A callback returning True asks the loop to stop after this step (saving a checkpoint
# when one is configured); the CLI uses it for Ctrl-C, progress bars and metrics.
Callback = Callable[[StepEvent], Optional[bool]]


def _check_inputs(op: str, runner: object, cfg: object, kind: type) -> None:
    if not isinstance(runner, Runner):
        raise ConfigError(f"{op}: expected a Runner, got {type(runner).__name__}")
    if not isinstance(cfg, kind):
        raise ConfigError(f"{op}: expected a {kind.__name__}, got {type(cfg).__name__}")


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


def _one_update(runner, cfg, opt, state, native, batch, step, log, logged, skipped=None):
    """Step with the loss when a log line is due (one host read), else without."""
    kw = dict(accumulation=cfg.accumulation, nonfinite=cfg.nonfinite, skipped=skipped)
    try:
        if cfg.log_every and step % cfg.log_every == 0:
            state, loss = step_batch_and_loss(runner, opt, state, native, batch, **kw)
            logged.append((step, loss))
            log(log_line(step, loss))
            return state, loss
        return step_batch(runner, opt, state, native, batch, **kw), None
    except NonFiniteError as e:
        raise NonFiniteError(f"step {step}: {e}") from None


def skip_counter(runner: Runner, cfg) -> Optional[torch.Tensor]:
    """The device-side count of skipped steps (skip mode), read only at the end."""
    return torch.zeros((), device=runner.device) if cfg.nonfinite == "skip" else None


def skipped_total(counter: Optional[torch.Tensor]) -> int:
    return 0 if counter is None else int(counter.item())  # intentional read, end of run


def _main_only(log: Log) -> tuple[Log, bool]:
    """Under torch.distributed only rank 0 logs and writes files."""
    main = distributed.is_main()
    return (log if main else (lambda line: None)), main


def _resume(op: str, cfg, runner: Runner, opt: Optimizer, kind: str, expect: dict):
    ck = load_checkpoint(cfg.resume_from, runner, optimizer=opt)
    p = ck.progress
    if p.get("kind") != kind or ck.state is None:
        raise CheckpointError(f"{op}: {cfg.resume_from}: not a {kind} training checkpoint with optimizer state")
    for key, value in expect.items():
        if p.get(key) != value:
            raise CheckpointError(
                f"{op}: {cfg.resume_from}: {key}: checkpoint has {p.get(key)!r}, this run has {value!r}"
            )
    if ck.state.path != ("native" if uses_native(runner, opt) else "generic"):
        raise CheckpointError(
            f"{op}: {cfg.resume_from}: the checkpoint's optimizer history is {ck.state.path}; "
            f"resume with parameters on the same kind of device"
        )
    return ck


# --------------------------------------------------------------------- in memory
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
    on_step: Optional[Callable[[int, OptState, Optional[float]], Optional[bool]]] = None,
    skipped: Optional[torch.Tensor] = None,
) -> tuple[OptState, list[tuple[int, float]], int]:
    """The fixed-step loop. Returns (state, logged (step, loss) pairs, steps done)."""
    native = state.path == "native"
    logged: list[tuple[int, float]] = []
    step = start_step
    while step < cfg.steps:
        batch = next_batch()
        state = schedule_state(step, state)  # the schedule advances per optimizer step
        state, loss = _one_update(runner, cfg, opt, state, native, batch, step, log, logged, skipped)
        step += 1
        watch_memory(step)
        if on_step is not None and on_step(step, state, loss):
            break
    return state, logged, step


def train_samples(
    runner: Runner, cfg: TrainConfig, samples: Sequence[Sample], *, log: Log = print,
    callback: Optional[Callback] = None,
) -> TrainReport:
    """Train on an in-memory list for ``cfg.steps`` updates of ``cfg.batch_size`` items.

    Items are taken cyclically in stored order (never shuffled); a batch may wrap
    around the end. The runner keeps the trained parameters and stays in train mode.
    """
    op = "train_samples"
    _check_inputs(op, runner, cfg, TrainConfig)
    if len(samples) == 0:
        raise DataError(f"{op}: empty sample list; nothing to train on")
    samples = [check_sample(op, s, i) for i, s in enumerate(samples)]
    start_time = time.perf_counter()
    n, k, opt = len(samples), cfg.batch_size, cfg.optimizer
    runner.train()
    log, main = _main_only(log)
    if cfg.resume_from is not None:
        ck = _resume(op, cfg, runner, opt, "samples", {"batch_size": k, "n_samples": n})
        state, progress = ck.state, ck.progress
        before, start, logged = progress["before"], progress["step"], [tuple(x) for x in progress["losses"]]
        distributed.start_replicas(runner, cfg.replica_check)
    else:
        distributed.start_replicas(runner, cfg.replica_check)
        before, start, logged = runner.mean_loss(samples), 0, []
        state = opt.init(runner.params, native=uses_native(runner, opt))
    watch = MemoryWatch(cadence(cfg.mem_watch, cfg.steps, runner.device), cfg.steps, runner.device, log)
    watch(start)
    batches = cyclic_batches(op, samples, k, cursor=(start * k) % n)

    def save(step: int, state: OptState) -> None:
        if not main:
            return  # rank 0 writes the checkpoints
        progress = {"kind": "samples", "step": step, "batch_size": k, "n_samples": n,
                    "before": before, "losses": logged + new_logged}
        save_checkpoint(cfg.checkpoint_path, runner, state=state, progress=progress)

    new_logged: list = []

    def on_step(step: int, state: OptState, loss: Optional[float]) -> bool:
        if loss is not None:
            new_logged.append((step - 1, loss))
        stop = bool(callback and callback(StepEvent(step, state, loss)))
        if cfg.checkpoint_path and (stop or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)):
            save(step, state)
        return stop

    skipped = skip_counter(runner, cfg)
    state, _, done = run_sample_steps(
        runner, cfg, lambda: next(batches), watch, opt, state,
        lambda t, s: s.with_lr(lr_for(cfg, t)), log=log, start_step=start, on_step=on_step,
        skipped=skipped,
    )
    if cfg.checkpoint_path and done == cfg.steps and not (cfg.checkpoint_every and done % cfg.checkpoint_every == 0):
        save(done, state)
    after = runner.mean_loss(samples)
    runner.sync()  # intentional, once: the module shows the trained values
    return TrainReport(
        before, after, done, done * k, tuple(logged + new_logged),
        time.perf_counter() - start_time, interrupted=done < cfg.steps,
        skipped_steps=skipped_total(skipped),
    )


def train_dataset(
    runner: Runner, cfg: TrainConfig, dataset: Dataset, *, log: Log = print,
    callback: Optional[Callback] = None,
) -> TrainReport:
    """``train_samples`` over the dataset's items in stored order."""
    if not isinstance(dataset, Dataset):
        raise ConfigError(f"train_dataset: expected a Dataset, got {type(dataset).__name__}")
    return train_samples(runner, cfg, dataset.to_list(), log=log, callback=callback)
