"""The learning-rate range test (``find_lr``): train a copy of the model for a few
updates while the rate grows exponentially, and read the loss curve.

The test runs ``train_loader`` on a deep copy of the runner's module (its current
values, on the same device), so the user's model, Parameter objects, buffers and any
optimizer state they hold are exactly as before; the random generators (global and the
loader's own) are put back as found, and a ``leantrain.DataLoader`` is immutable, so the
data position is unchanged too. The rate at update ``t`` of ``steps`` is ``start_lr *
(end_lr / start_lr) ** (t / (steps - 1))``; the loss of each update is its pre-update
loss, smoothed by an exponential moving average with bias correction (as fastai and
Lightning do). The test stops early once the smoothed loss passes ``diverge`` times its
best, or is not finite. The suggestion is the rate where the smoothed loss falls
fastest (its steepest slope against log rate, before its minimum, past the first points
where the average settles), the usual reading of the curve; it is a starting point, not
a guarantee.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterator, Optional, Union

import numpy

from .errors import ConfigError
from .optim import Optimizer, Schedule
from .training.loops.callbacks import Callback
from .training.loops.config import LoaderTrainConfig
from .training.loops.loader_loop import train_loader
from .training.runner.binding import rng_preserved
from .training.loops.batches import loader_generators
from .training.runner.runner import Runner
from .validate import check_count, is_number


# What the range test sets itself, and the loop options it takes from the caller.
OWN = ("checkpoint_path", "resume_from", "eval_data", "epochs", "max_steps", "scheduler", "log_every",
       "schedule_per", "measure_loss", "nonfinite", "optimizer", "accumulate", "checkpoints", "evaluation")
LOOP_OPTIONS = {f.name for f in fields(LoaderTrainConfig)} | {"parallel"}


@dataclass(frozen=True)
class SweepSchedule(Schedule):
    """``start * (end / start) ** (t / (steps - 1))`` at update ``t``."""

    start: float
    end: float
    steps: int

    def lr_at(self, t: int) -> float:
        return self.start * (self.end / self.start) ** (t / max(self.steps - 1, 1))

    def max_rate(self) -> float:
        return max(self.start, self.end)


@dataclass(frozen=True)
class LRFinderResult:
    """The sweep: ``lrs[i]`` and the pre-update ``losses[i]`` of update ``i`` (and
    ``smoothed[i]``), ``suggestion`` (``None`` when the curve never fell), and whether
    the test stopped early on divergence."""

    lrs: tuple[float, ...]
    losses: tuple[float, ...]
    smoothed: tuple[float, ...]
    suggestion: Optional[float]
    diverged: bool

    def plot(self, path: Union[str, Path]) -> Path:
        """The loss against the rate (log scale), the suggestion marked, saved to ``path``."""
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        try:
            ax.plot(self.lrs, self.losses, alpha=0.35, label="loss")
            ax.plot(self.lrs, self.smoothed, label="smoothed")
            if self.suggestion is not None:
                ax.axvline(self.suggestion, color="red", linestyle="--", label=f"suggested {self.suggestion:.2e}")
            ax.set_xscale("log")
            low, first = min(self.smoothed, default=0.0), self.smoothed[0] if self.smoothed else 0.0
            if math.isfinite(low) and math.isfinite(first) and first > low:  # the curve, not its blow-up
                span = first - low
                ax.set_ylim(low - 0.2 * span, first + 0.5 * span)
            ax.set_xlabel("learning rate")
            ax.set_ylabel("loss (before the update)")
            ax.legend()
            fig.tight_layout()
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path)
        finally:
            plt.close(fig)
        return path


class _Watch(Callback):
    """Keeps each update's loss and rate; stops on divergence."""

    reads_only = True

    def __init__(self, smoothing: float, diverge: float) -> None:
        self.smoothing, self.diverge = smoothing, diverge
        self.lrs: list[float] = []
        self.losses: list[float] = []
        self.smoothed: list[float] = []
        self.avg, self.best, self.diverged = 0.0, math.inf, False

    def on_step(self, event) -> bool:
        loss = float(event.loss)
        self.lrs.append(float(event.state.lr))
        self.losses.append(loss)
        beta = 1.0 - self.smoothing
        self.avg = beta * self.avg + (1.0 - beta) * loss
        value = self.avg / (1.0 - beta ** len(self.losses))  # bias-corrected
        self.smoothed.append(value)
        if not math.isfinite(value) or value > self.diverge * self.best:
            self.diverged = True
            return True
        self.best = min(self.best, value)
        return False


def suggest(lrs: list[float], smoothed: list[float]) -> Optional[float]:
    """The rate of steepest descent of the smoothed loss against log rate, before its
    minimum; the first points (up to 10, a tenth of the sweep when it is short) are left
    out, where the average is still settling, as Lightning does."""
    finite = [i for i, v in enumerate(smoothed) if math.isfinite(v)]
    if len(finite) < 3:
        return None
    end = min(finite, key=lambda i: smoothed[i]) + 1
    skip = min(10, len(smoothed) // 10)
    if end - skip < 3:
        return None
    slope = numpy.gradient(numpy.asarray(smoothed[skip:end]), numpy.log(numpy.asarray(lrs[skip:end])))
    i = int(numpy.argmin(slope))
    return float(lrs[skip + i]) if slope[i] < 0 else None


def find_lr(runner: Runner, data, optimizer: Optimizer, *, start_lr: float = 1e-7, end_lr: float = 10.0,
            steps: int = 100, accumulate: int = 1, smoothing: float = 0.05, diverge: float = 4.0,
            plot: Optional[Union[str, Path]] = None, **options) -> LRFinderResult:
    """The learning-rate range test on a copy of ``runner`` (see the module docstring).

    Args:
        runner: the model; left exactly as it is.
        data: what ``train_loader`` reads (a loader, a list of batches); read again
            from its start if the sweep outlasts it.
        optimizer: the optimizer to sweep (its own rate is replaced by the sweep's).
        start_lr: the sweep's first rate (0 < start_lr < end_lr).
        end_lr: the sweep's last rate.
        steps: updates in the sweep (at least 3).
        accumulate: loader batches per update, as in ``LoaderTrainConfig``.
        smoothing: the moving average's weight of each new loss (0 < smoothing <= 1).
        diverge: stop once the smoothed loss passes this multiple of its best (> 1).
        plot: write the curve to this image file.
        **options: other ``LoaderTrainConfig`` options (``autocast``, ``clip_grad_norm``...).

    Returns:
        An ``LRFinderResult``.
    """
    op = "find_lr"
    if not isinstance(runner, Runner):
        raise ConfigError(f"{op}: expected a Runner, got {type(runner).__name__}")
    if not isinstance(optimizer, Optimizer):
        raise ConfigError(f"{op}: optimizer must be built with leantrain.optim, got {type(optimizer).__name__}")
    if not (is_number(start_lr) and is_number(end_lr) and 0 < start_lr < end_lr < math.inf):
        raise ConfigError(f"{op}: expected 0 < start_lr < end_lr, got start_lr={start_lr!r}, end_lr={end_lr!r}")
    check_count(op, "steps", steps, 3)
    if not (is_number(smoothing) and 0 < smoothing <= 1):
        raise ConfigError(f"{op}: smoothing must be in (0, 1], got {smoothing!r}")
    if not (is_number(diverge) and diverge > 1):
        raise ConfigError(f"{op}: diverge must be a number > 1, got {diverge!r}")
    for key in options:
        if key in OWN:
            raise ConfigError(f"{op}: {key} is the range test's own to set (it sweeps the rate by update, skips "
                              f"non-finite updates, saves and evaluates nothing)")
        if key not in LOOP_OPTIONS:
            raise ConfigError(f"{op}: unknown option {key!r} (it takes LoaderTrainConfig's options other than "
                              f"{', '.join(OWN)})")
    if isinstance(data, Iterator):
        raise ConfigError(f"{op}: data is a one-shot iterator ({type(data).__name__}); the sweep reads the data "
                          f"again from its start when it outlasts it: pass a re-iterable loader (a list of batches, "
                          f"a leantrain.DataLoader, a torch DataLoader)")
    cfg = LoaderTrainConfig(epochs=None, max_steps=steps, optimizer=optimizer, accumulate=accumulate,
                            scheduler=SweepSchedule(start_lr, end_lr, steps), schedule_per="step", log_every=1,
                            measure_loss=False, nonfinite="skip", **options)
    try:
        module = copy.deepcopy(runner.module)
    except Exception as e:  # the user's module: anything it raises when copied
        raise ConfigError(f"{op}: the model cannot be copied (copy.deepcopy raised {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); the range test trains a copy so that the "
                          f"model stays as it is") from None
    trial = Runner.from_module(module, runner.loss_fn)
    for mine, theirs in zip(trial.params.storages(), runner.params.storages()):
        mine.write_host(theirs.newest().detach().to("cpu"))  # the runner's current values, device mirrors included
    if runner.params.has_mirrors():
        trial.to(runner.device)
    watch = _Watch(smoothing, diverge)
    with rng_preserved(runner.device, loader_generators(data)):
        saved = data.state_dict() if hasattr(data, "state_dict") and hasattr(data, "load_state_dict") else None
        try:
            train_loader(trial, cfg, data, log=None, callbacks=[watch])
        finally:
            if saved is not None:
                data.load_state_dict(saved)  # a stateful loader's position, as it was
    result = LRFinderResult(tuple(watch.lrs), tuple(watch.losses), tuple(watch.smoothed),
                            suggest(watch.lrs, watch.smoothed), watch.diverged)
    if plot is not None:
        result.plot(plot)
    return result
