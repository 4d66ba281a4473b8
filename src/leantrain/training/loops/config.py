"""Loop configurations and the training report (spec §4). Configuration is data:
frozen dataclasses, validated when built."""

from __future__ import annotations

import math
import os
import dataclasses
from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

from ...errors import ConfigError
from ...optim import Optimizer, Schedule, sgd
from ...optim.clipping import check_clip
from ..runner.ema import check_decay
from ..runner.neftune import check_alpha
from ..runner.precision import check_autocast
from ...validate import check_bool, check_choice, check_count, is_int
from .checkpoint_folder import template_fields
from .evaluation import check_limit
from .settings import LOADER, flat_keywords, group, settings_of
from .run_options import check_run_options
from .schedule_index import check_epoch_indexing, epoch_schedule_varies  # noqa: F401 (the loader loop's too)
from ..parallel.engines import torch_engine
from ..update.options import ACCUMULATION_MODES, NONFINITE_MODES

PathArg = Union[str, os.PathLike]


def _common(op: str, cfg) -> None:
    """The records' own checks (``group``), then the settings no record owns and what ties
    records together."""
    group(op, cfg, cfg.__dict__.pop("_flat", {}))
    par, ev = cfg.parallel, cfg.evaluation
    if not isinstance(cfg.optimizer, Optimizer):
        raise ConfigError(
            f"{op}: optimizer must be built with leantrain.optim (e.g. optim.adam(1e-3)), "
            f"got {type(cfg.optimizer).__name__}"
        )
    if cfg.scheduler is not None and not isinstance(cfg.scheduler, Schedule):
        raise ConfigError(
            f"{op}: scheduler must be a leantrain.optim schedule or None, got "
            f"{type(cfg.scheduler).__name__}"
        )
    check_count(op, "log_every", cfg.log_every, 0)
    check_choice(op, "nonfinite", cfg.nonfinite, NONFINITE_MODES)
    check_choice(op, "accumulation", cfg.accumulation, ACCUMULATION_MODES)
    check_bool(op, "measure_loss", cfg.measure_loss)
    check_bool(op, "log_memory", cfg.log_memory)
    check_alpha(op, cfg.neftune_noise_alpha)
    check_clip(op, cfg.clip_grad_norm, cfg.clip_grad_value)
    check_decay(op, cfg.ema_decay)
    check_autocast(op, cfg.autocast)
    check_bool(op, "compile", cfg.compile)
    check_run_options(op, cfg)
    if par.sharding == "parameters":
        for what, bad in (("compile=True", cfg.compile),
                          ("accumulation='vectorized'", cfg.accumulation == "vectorized")):
            if bad:
                raise ConfigError(f"{op}: sharding='parameters' does not take {what} yet (the parameters are "
                                  f"gathered module by module, item by item); use sharding='gradients' for it")
    if cfg.averaging is not None:
        from ..runner.averaging import Averaging

        if not isinstance(cfg.averaging, Averaging):
            raise ConfigError(f"{op}: averaging must be a leantrain Averaging (of a torch AveragedModel), got "
                              f"{type(cfg.averaging).__name__}")
        if par.sharded:
            raise ConfigError(f"{op}: averaging updates the AveragedModel from the whole module: it does not "
                              f"run with {par.cut_by} (use ema_decay, which averages on the shards)")
    if ev.ema and cfg.ema_decay is None:
        raise ConfigError(f"{op}: eval_ema evaluates the moving average: set ema_decay")
    if torch_engine(par.engine):
        for what, bad in (("accumulation='vectorized'", cfg.accumulation == "vectorized"),
                          ("compile=True", cfg.compile)):
            if bad:
                raise ConfigError(f"{op}: engine={par.engine.name!r} differentiates item by item through torch's wrapper; it "
                                  f"does not take {what} yet: use engine='leantrain' for it")
    if par.exact_reduction and cfg.accumulation != "exact":
        raise ConfigError(f"{op}: exact_reduction folds items one by one: it needs accumulation='exact'")
    _check_kept_folder(op, cfg)


def _check_kept_folder(op: str, cfg) -> None:
    """A folder of checkpoints against the other records: never sharded, and ranked by
    an evaluation result the run gives."""
    ck, names = cfg.checkpoints, cfg.evaluation.result_names()
    if template_fields(ck.path) is None:
        return
    if cfg.parallel.sharded:
        raise ConfigError(f"{op}: a folder of checkpoints ({{step}} in checkpoint_path) is not kept for sharded "
                          f"runs ({cfg.parallel.cut_by}), whose checkpoint is itself a folder: give a plain "
                          f"checkpoint_path")
    if (ck.keep_best is not None or ck.load_best_at_end) and cfg.evaluation.data is None:
        raise ConfigError(f"{op}: keep_best and load_best_at_end choose by an evaluation's {ck.monitor!r}: "
                          f"set eval_data")
    if ck.keep_best is not None and ck.monitor not in names:
        raise ConfigError(f"{op}: keep_best monitors {ck.monitor!r}, but the evaluations give {sorted(names)}")


SCHEDULE_PER = ("epoch", "step")


def scheduled(cfg):
    """The loop's schedule step, ``(t, state) -> state``: the state with index ``t``'s rates
    (each param group's, and the momenta a cycling schedule sets), or the optimizer's own
    rate without a schedule."""
    if cfg.scheduler is None:
        lr = cfg.optimizer.lr
        return lambda t, s: s.with_lr(lr)
    sched = cfg.scheduler
    rates = sched.rates_at

    def at(t: int, s):
        try:
            return s.with_rates(*rates(t))
        except ConfigError as e:  # a rate the optimizer refuses: say which schedule gave it, and where
            raise ConfigError(f"the scheduler {type(sched).__name__} gives at index {t} what the optimizer refuses "
                              f"({e}); a schedule's rates must be finite and >= 0 at every index") from None

    return at


@dataclass(frozen=True, kw_only=True)
class LoopOptions:
    """Options both loops share beyond the upstream configs (keyword-only).

    The settings of the run's components are records, each declared, documented and
    checked in its component's module: ``checkpoints`` (``CheckpointOptions``: where and
    when checkpoints go, what a run resumes from, the kept folder), ``evaluation``
    (``EvalOptions``: what is evaluated and when) and ``parallel`` (``ParallelOptions``:
    how the ranks share a run, sharding). Each of their settings is also a keyword of the
    config by its flat spelling: ``checkpoint_path``, ``checkpoint_every``,
    ``resume_from``, ``keep_last``, ``keep_best``, ``monitor``, ``mode``,
    ``load_best_at_end``; ``eval_data``, ``eval_every``, ``eval_metrics``, ``eval_ema``,
    ``eval_draws``, ``eval_at_end`` (loaders also ``eval_every_epochs``); ``sharding``,
    ``shard_by``, ``exact_reduction``, ``collective_timeout``, ``replica_check``, ``engine``,
    ``init_weights``, ``init_from``, ``gather_at_end``, ``item_seeds``, ``shard_units``.
    ``cfg.checkpoint_every`` reads one back, ``dataclasses.replace(cfg, eval_every=5)``
    changes one; a setting given both ways with two values is refused. After
    construction the config always holds the three records.

    The others: ``accumulation``: ``"exact"`` (item by item) or ``"vectorized"``
    (stacked); ``nonfinite``: ``"raise"`` or ``"skip"`` for NaN/inf losses and gradients;
    ``seed``/``deterministic``/``peak_flops``/``profile``/``profile_dir``: see
    ``run_options.py``; ``measure_loss=False`` skips the ``before``/``after`` passes;
    ``clip_grad_norm``/``clip_grad_value``: clip the mean canonical gradients before each
    update (one of them; ``torch.nn.utils.clip_grad_norm_``'s rule), the norm before
    clipping reported on logged steps (``TrainReport.grad_norms``, ``StepEvent.grad_norm``);
    ``ema_decay``: keep a moving average of the weights (``Runner.ema_values()``, saved in
    checkpoints; see ema.py); ``averaging``: drive the user's
    ``torch.optim.swa_utils.AveragedModel`` (``Averaging``: every N updates, from update
    K, torchvision's warm-up reset), kept in checkpoints (one process;
    ``runner/averaging.py``); ``neftune_noise_alpha``: NEFTune's embedding noise while
    training (a Hugging Face model; Trainer's, ``runner/neftune.py``); ``log_memory``:
    each logged update's metrics add ``peak_memory_mib``, the peak since the last log line
    (CUDA's allocator peak; on CPU the peak resident set), as Lightning's
    ``DeviceStatsMonitor``; ``autocast``: ``"bfloat16"`` or ``"float16"`` mixed precision
    (precision.py; float16 scales the loss and skips overflow steps whatever
    ``nonfinite`` says); ``compile``: each item's loss and gradients through
    ``torch.compile`` (compiled.py: faster kernels that may round differently, so exact
    only against itself).
    """

    accumulation: str = "exact"
    nonfinite: str = "raise"
    measure_loss: bool = True
    clip_grad_norm: Optional[float] = None
    clip_grad_value: Optional[float] = None
    ema_decay: Optional[float] = None
    log_memory: bool = False
    neftune_noise_alpha: Optional[float] = None
    averaging: Optional[object] = None
    autocast: Optional[str] = None
    compile: bool = False
    seed: Optional[int] = None
    deterministic: Union[bool, str] = False
    peak_flops: Optional[float] = None
    profile: Optional[tuple[int, int]] = None
    profile_dir: Optional[PathArg] = None
    # The components' records (given, or built from the flat keywords; always set after construction).
    checkpoints: Optional[CheckpointOptions] = None
    evaluation: Optional[EvalOptions] = None
    parallel: Optional[ParallelOptions] = None


@flat_keywords
@dataclass(frozen=True)
class TrainConfig(LoopOptions):
    """In-memory training: ``steps`` optimizer updates of ``batch_size`` items each.

    ``batch_size`` items are averaged into one update (it does not multiply the
    number of updates); the schedule advances per update; a log line is printed for the
    first update and every ``log_every``-th after it (0 disables logging and its host
    reads).
    """

    steps: int
    batch_size: int = 1
    optimizer: Optimizer = field(default_factory=lambda: sgd(0.01))
    scheduler: Optional[Schedule] = None
    log_every: int = 1
    mem_watch: int = 0

    def __post_init__(self) -> None:
        op = "TrainConfig"
        check_count(op, "steps", self.steps, 0)
        check_count(op, "batch_size", self.batch_size, 1)
        check_count(op, "mem_watch", self.mem_watch, 0)
        _common(op, self)



@flat_keywords
@dataclass(frozen=True)
class LoaderTrainConfig(LoopOptions):
    """Loader training: ``epochs`` passes, read lazily (see ``streams.py``); one update
    per ``accumulate`` loader batches (the list-batch mean over all their items; an
    epoch's short tail group is its own mean); the step counter counts updates, across
    epochs.

    ``max_steps``: stop after that many updates (counted over the whole run, resumed
    ones included), mid-epoch if need be: with an endless stream, ``epochs=1`` and
    ``max_steps=N``. A fractional ``epochs`` (Trainer's ``num_train_epochs=1.5``): the
    whole epochs, then that fraction of the next epoch's updates, rounded up (a loader with
    a length). ``schedule_per``: ``"epoch"`` (upstream's rule: the schedule's
    index is the epoch) or ``"step"`` (its index is the update, so ``warmup_cosine``
    warms up over updates). ``measure_batches``: the ``before``/``after`` losses read the
    first this many batches of a measuring pass (default 1: the same batch at the first
    and at the final weights, two forwards in the whole run; ``None``: one whole pass each,
    upstream's measure, two more forwards over all the data); they are measured only where a
    pass does not change what training reads (see ``Stream.measurable``), else ``None``.
    ``pieces``: cut every loader item along dimension 0 into at most this many items
    (``split_rows``), so a collated batch is shared by the ranks under
    ``torch.distributed`` (item ``j`` on rank ``j mod world``); a number that does not
    depend on the world size keeps ``exact_reduction``'s bits the same on any number of
    ranks. Pieces count as items in ``samples_seen``; ``before``/``after`` read uncut items.
    ``limit_train_batches``: each epoch reads at most that many of the loader's batches (an
    integer), or that fraction of them (a float in (0, 1] of a loader with a length, rounded
    down), as Lightning's: the quick-iteration habit; a resume is exact, and refused with
    another limit."""

    epochs: Union[None, int, float]
    optimizer: Optimizer = field(default_factory=lambda: sgd(0.01))
    scheduler: Optional[Schedule] = None
    log_every: int = 1
    # loader batches per update: their items' mean, a short tail its own; or a schedule by
    # epoch, {first epoch (from 0): batches per update} (Lightning's GradientAccumulationScheduler)
    accumulate: Union[int, Mapping[int, int]] = 1
    max_steps: Optional[int] = None
    schedule_per: str = "epoch"
    measure_batches: Optional[int] = 1  # None: whole passes (upstream's; a run's cost grows by two forwards per batch)
    pieces: Optional[int] = None
    limit_train_batches: Union[None, int, float] = None

    def __post_init__(self) -> None:
        op = "LoaderTrainConfig"
        if self.epochs is None:
            if self.max_steps is None:
                raise ConfigError(f"{op}: epochs=None trains until max_steps: set max_steps")
        elif isinstance(self.epochs, float):  # Trainer's num_train_epochs=1.5: the last epoch's fraction of updates
            if not (math.isfinite(self.epochs) and self.epochs > 0):
                raise ConfigError(f"{op}: epochs must be an integer >= 0 or a finite number > 0 of epochs (1.5: "
                                  f"one epoch and half the next one's updates), got {self.epochs!r}")
        else:
            check_count(op, "epochs", self.epochs, 0)
        if isinstance(self.accumulate, Mapping):
            sched = self.accumulate
            if not sched or not all(is_int(e) and e >= 0 and is_int(k) and k >= 1 for e, k in sched.items()):
                raise ConfigError(f"{op}: accumulate as a schedule maps first epochs (integers >= 0, from 0) to "
                                  f"loader batches per update (integers >= 1), got {dict(sched)!r}")
            object.__setattr__(self, "accumulate", dict(sorted(sched.items())))
        else:
            check_count(op, "accumulate", self.accumulate, 1)
        for name in ("max_steps", "measure_batches", "pieces"):
            if getattr(self, name) is not None:
                check_count(op, name, getattr(self, name), 1)
        check_choice(op, "schedule_per", self.schedule_per, SCHEDULE_PER)
        check_limit(op, "limit_train_batches", self.limit_train_batches)
        _common(op, self)
        check_epoch_indexing(op, self.scheduler, None if self.epochs is None else math.ceil(self.epochs),
                             self.schedule_per)

    def accumulate_at(self, epoch: int) -> int:
        """Loader batches per update in epoch ``epoch`` (from 0): ``accumulate``, or the
        schedule's factor from its latest first epoch at or before ``epoch`` (1 before its first)."""
        if isinstance(self.accumulate, int):  # asked per loader batch: not typing.Mapping's slow check
            return self.accumulate
        k = 1
        for first, factor in self.accumulate.items():
            if first <= epoch:
                k = factor
        return k

    def accumulate_record(self):
        """``accumulate`` as a checkpoint records it (JSON: a schedule as ``[[epoch, k], ...]``)."""
        return [[e, k] for e, k in self.accumulate.items()] if isinstance(self.accumulate, Mapping) else self.accumulate


@dataclass(frozen=True)
class TrainReport:
    """Mean training loss before and after, plus what the run did.

    ``losses`` holds the logged ``(update, loss)`` pairs (the update's number, from 1, and
    the loss measured before it); ``grad_norms`` and ``evals`` name updates alike.
    ``samples_seen`` counts the items trained on (loader items, or their pieces).
    """

    before: Optional[float]  # None with measure_loss=False
    after: Optional[float]
    steps: int = 0
    samples_seen: int = 0
    losses: tuple[tuple[int, float], ...] = ()
    wall_time: float = 0.0
    interrupted: bool = False
    skipped_steps: int = 0
    evals: tuple = ()  # (step, evaluate's results) per evaluation
    grad_norms: tuple[tuple[int, float], ...] = ()  # (step, norm before clipping), logged steps
    best_checkpoint: Optional[str] = None  # with keep_best: the best checkpoint kept (loaded with load_best_at_end)
    resumed_from: Optional[str] = None  # the checkpoint this run continued (resume_from, "auto" resolved)
    # token data (dict items with input_ids): the tokens of this run's updates (an attention_mask's ones where
    # the inputs have one, else input_ids' size; Trainer's num_input_tokens_seen counts these), over every rank
    tokens_seen: Optional[int] = None
    # the mean over the run's updates of each update's mean loss (before its step; the items weighted as the
    # update weights them), resumed updates included: Trainer's train_loss (None: a resume from an older file)
    train_loss: Optional[float] = None


def run_config(cfg) -> dict:
    """A loop config as plain data (what trackers record as the run's settings): numbers,
    strings and flags as they are, the optimizer as its kind and hyperparameters, paths
    as strings, data as its kind (and size when known), anything else as its repr."""
    out: dict = {}
    loader = hasattr(cfg, "epochs")
    for name, v in settings_of(cfg):
        if name in LOADER and not loader:
            continue
        if v is None or isinstance(v, (bool, int, float, str)):
            out[name] = v
        elif isinstance(v, Optimizer):
            out[name] = v.kind
            out.update({f"{name}.{k}": _plain(x) for k, x in dataclasses.asdict(v.hyper).items()})
        elif isinstance(v, os.PathLike):
            out[name] = os.fspath(v)
        elif name == "eval_data":
            sets = v if isinstance(v, Mapping) else {"": v}
            out[name] = ", ".join(f"{k or type(d).__name__}" + (f"({len(d)})" if hasattr(d, "__len__") else "")
                                  for k, d in sets.items())
        elif name == "eval_metrics":
            out[name] = ", ".join(v)
        else:
            out[name] = _plain(v)
    return out


def _plain(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (tuple, list)) and all(isinstance(x, (bool, int, float, str)) for x in v):
        return list(v)
    return repr(v)
