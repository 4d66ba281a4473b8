"""The batch-size finder (``find_batch_size``; Trainer's ``auto_find_batch_size``, Lightning's
``BatchSizeFinder`` in its "power" mode): the largest batch that fits, found by doubling.

Each trial trains a copy of the runner's module (its current values, on its device) for
``steps`` updates with the optimizer, its state and the accumulation as the run will have
them, on ``make_loader(batch_size)``'s batches, and reads the peak memory: on CUDA the
allocator's peak, a trial that runs out of memory not fitting (the cache emptied after
it); on CPU the process's peak resident set, which must stay within ``memory_budget``
(bytes: there is no "out of memory" to wait for there; memory the process freed earlier
and still holds is reused without raising that peak, so in a long-lived process the
figure can be below what a fresh one needs for small tensors: give the budget for the
whole process and leave a margin). The user's model, Parameter
objects, buffers and optimizer state are untouched (only the copy trains), every global
generator is put back, and the loaders are the finder's own (``make_loader`` builds a
fresh one per trial), so the run that follows starts as it would have.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .errors import ConfigError
from .optim import Optimizer
from .training.loops.config import LoaderTrainConfig
from .training.loops.loader_loop import train_loader
from .training.loops.memory import peak_since_last
from .training.runner.binding import rng_preserved
from .training.runner.runner import Runner
from .validate import check_count, is_number


OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


@dataclass(frozen=True)
class BatchSizeResult:
    """``batch_size``: the largest that fitted (``None``: not even the first; the search
    also stops once one batch holds all the data);
    ``trials``: ``(batch size, peak bytes or None when it ran out of memory, fitted)`` in order."""

    batch_size: Optional[int]
    trials: tuple


def find_batch_size(runner: Runner, make_loader: Callable[[int], object], optimizer: Optimizer, *, start: int = 1,
                    max_batch_size: Optional[int] = None, memory_budget: Optional[int] = None, steps: int = 2,
                    accumulate: int = 1, **options) -> BatchSizeResult:
    """The largest batch size that fits, doubling from ``start`` (see the module docstring).

    Args:
        runner: the model; left exactly as it is.
        make_loader: ``batch_size -> loader`` (what ``train_loader`` reads), built per trial.
        optimizer: the run's optimizer (its state is made and kept as the run's would be).
        start: the first batch size tried; max_batch_size: stop doubling there.
        memory_budget: bytes the peak may reach (required on CPU; on CUDA, default: the
            device's free memory when the search starts).
        steps: updates per trial (the optimizer state exists from the first one).
        accumulate: loader batches per update, as the run will have.
        **options: other ``LoaderTrainConfig`` options (``autocast``, ``clip_grad_norm``...).
    """
    op = "find_batch_size"
    if not isinstance(runner, Runner):
        raise ConfigError(f"{op}: expected a Runner, got {type(runner).__name__}")
    if not isinstance(optimizer, Optimizer):
        raise ConfigError(f"{op}: optimizer must be built with leantrain.optim, got {type(optimizer).__name__}")
    if not callable(make_loader):
        raise ConfigError(f"{op}: make_loader must be a function of the batch size returning a loader")
    check_count(op, "start", start, 1)
    check_count(op, "steps", steps, 1)
    if max_batch_size is not None:
        check_count(op, "max_batch_size", max_batch_size, start)
    cuda = runner.device.type == "cuda"
    if memory_budget is None:
        if not cuda:
            raise ConfigError(f"{op}: on {runner.device.type} give memory_budget (bytes the process's peak resident "
                              f"memory may reach): without a device's free memory there is no limit to find")
        memory_budget = torch.cuda.mem_get_info(runner.device)[0] + torch.cuda.memory_allocated(runner.device)
    if not (is_number(memory_budget) and 0 < memory_budget < math.inf):  # inf: a doubling that never ends
        raise ConfigError(f"{op}: memory_budget must be a finite number of bytes > 0, got {memory_budget!r}")
    known = {f.name for f in dataclasses.fields(LoaderTrainConfig)}
    for key in options:
        if key in ("epochs", "max_steps", "checkpoint_path", "resume_from", "eval_data", "measure_loss", "log_every"):
            raise ConfigError(f"{op}: {key} is the finder's own to set")
        if key not in known:
            raise ConfigError(f"{op}: {key!r} is not a LoaderTrainConfig option (the finder takes the run's "
                              f"options: autocast, clip_grad_norm, averaging...; its trials run no callbacks)")
    cfg = LoaderTrainConfig(epochs=None, max_steps=steps, optimizer=optimizer, accumulate=accumulate, log_every=0,
                            measure_loss=False, **options)
    trials, best, size = [], None, start
    with rng_preserved(runner.device):
        while max_batch_size is None or size <= max_batch_size:
            loader = make_loader(size)
            # the user's averaged model stays theirs: each trial averages a copy of it
            trial_cfg = cfg if cfg.averaging is None else dataclasses.replace(cfg, averaging=_copied(op, cfg.averaging))
            peak = _trial(op, runner, trial_cfg, loader)
            fits = peak is not None and peak <= memory_budget
            trials.append((size, peak, fits))
            if not fits:
                break
            best, size = size, size * 2
            if _whole(loader):  # one batch holds all the data: a larger size reads the same batch
                break
    return BatchSizeResult(best, tuple(trials))


def _copied(op: str, averaging):
    """A copy of ``averaging`` (an ``Averaging``, its ``AveragedModel`` copied with it)."""
    try:
        return copy.deepcopy(averaging)
    except Exception as e:  # the user's object: anything it raises when copied
        raise ConfigError(f"{op}: averaging cannot be copied (copy.deepcopy raised {type(e).__name__}); the finder "
                          f"averages a copy so that yours stays as it is") from None


def _whole(loader) -> bool:
    try:
        return len(loader) <= 1
    except TypeError:  # a loader without a length: keep doubling (the budget stops it)
        return False


def _trial(op: str, runner: Runner, cfg: LoaderTrainConfig, loader) -> Optional[int]:
    """The peak memory of ``cfg``'s updates on a copy of the runner (``None``: out of memory)."""
    try:
        module = copy.deepcopy(runner.module)
    except Exception as e:  # the user's module: anything it raises when copied
        raise ConfigError(f"{op}: the model cannot be copied (copy.deepcopy raised {type(e).__name__}); the finder "
                          f"trains a copy so that the model stays as it is") from None
    trial = Runner.from_module(module, runner.loss_fn)
    for mine, theirs in zip(trial.params.storages(), runner.params.storages()):
        mine.write_host(theirs.newest().detach().to("cpu"))
    if runner.params.has_mirrors():
        trial.to(runner.device)
    peak_since_last(runner.device)  # the trial's own peak from here
    out_of_memory = False
    try:
        train_loader(trial, cfg, loader, log=None)
    except OUT_OF_MEMORY:  # left behind before the cache is emptied (the traceback holds the trial's tensors)
        out_of_memory = True
    peak = None if out_of_memory else peak_since_last(runner.device)
    del trial, module
    if out_of_memory:
        torch.cuda.empty_cache()
    return peak
