"""A loop config's settings grouped by the component that owns them: ``CheckpointOptions``
(the ``Checkpointer``), ``EvalOptions`` (evaluation), ``ParallelOptions`` (the
``Strategy``). Each record checks its own fields when it is built.

A config takes a record (``LoaderTrainConfig(..., checkpoints=CheckpointOptions(path=...,
every=100, keep_last=2))``) or the same settings by their flat names
(``checkpoint_path=..., checkpoint_every=100, keep_last=2``); both read back either
way (``cfg.checkpoints.every``, ``cfg.checkpoint_every``). A setting given both ways
with two different values is refused. ``dataclasses.replace(cfg, checkpoint_every=5)``
works as for any dataclass: the config's own records, handed back by ``replace``, are
rebuilt from the flat fields.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable, ClassVar, Mapping, Optional, Union

from torch import nn

from ...errors import ConfigError
from ...validate import check_bool, check_choice, check_count
from ..parallel.sharding.plan import SHARD_BY, SHARDING_MODES
from .checkpoint_folder import check_template
from .evaluation import check_eval_sets

PathArg = Union[str, os.PathLike]


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """Where and when checkpoints are written and what a run resumes from.

    ``path``: the checkpoint (a file replaced at each save; ``{step}`` in its name keeps
    a folder of files, see ``checkpoint_folder.py``); ``every``: save every N updates
    (and at the end); ``resume_from``: continue exactly from a checkpoint (``"auto"``:
    from ``path`` when one exists there, else start fresh); ``keep_last``/``keep_best``:
    the folder keeps the newest K / the best K by ``monitor`` (an evaluation result) and
    ``mode``; ``load_best_at_end``: the best one's parameters back in the model at the end."""

    path: Optional[PathArg] = None
    every: int = 0
    resume_from: Optional[PathArg] = None
    keep_last: Optional[int] = None
    keep_best: Optional[int] = None
    monitor: str = "loss"
    mode: str = "min"
    load_best_at_end: bool = False

    FLAT: ClassVar[dict] = {"path": "checkpoint_path", "every": "checkpoint_every", "resume_from": "resume_from",
                            "keep_last": "keep_last", "keep_best": "keep_best", "monitor": "monitor", "mode": "mode",
                            "load_best_at_end": "load_best_at_end"}
    OP: ClassVar[str] = "CheckpointOptions"

    def __post_init__(self) -> None:
        op = self.OP
        for name in ("path", "resume_from"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ConfigError(f"{op}: {self.FLAT[name]} must be a path or None, got {type(value).__name__}")
        check_count(op, "checkpoint_every", self.every, 0)
        if self.resume_from == "auto" and self.path is None:
            raise ConfigError(f"{op}: resume_from='auto' resumes from checkpoint_path: set one")
        if self.every and self.path is None:
            raise ConfigError(f"{op}: checkpoint_every={self.every} needs a checkpoint_path")
        for name in ("keep_last", "keep_best"):
            if getattr(self, name) is not None:
                check_count(op, name, getattr(self, name), 1)
        check_choice(op, "mode", self.mode, ("min", "max"))
        check_bool(op, "load_best_at_end", self.load_best_at_end)
        if not isinstance(self.monitor, str):
            raise ConfigError(f"{op}: monitor must be an evaluation result's name, got {self.monitor!r}")
        if self.load_best_at_end and self.keep_best is None:
            raise ConfigError(f"{op}: load_best_at_end loads the best checkpoint kept: set keep_best (e.g. 1)")
        managed = self.keep_last is not None or self.keep_best is not None or self.load_best_at_end
        check_template(op, self.path, managed)


# What an evaluation names itself, and what the metrics files' records name: no metric's name.
RESERVED = ("loss", "items", "kind", "step", "epoch")


@dataclass(frozen=True, kw_only=True)
class EvalOptions:
    """What a loop evaluates and when: ``data`` (a set, or a dict of named sets whose
    results are named ``val_loss``, ``test_loss``...), ``every`` N updates (loaders also
    ``every_epochs``; with neither, an in-memory loop evaluates after every update and a
    loader loop after every epoch), ``metrics`` (``{name: fn(output, target)}``), ``ema``
    (evaluate the moving average of the weights), ``draws``: ``"restore"`` (the default:
    an evaluation changes nothing, every generator it draws from is put back) or
    ``"advance"`` (as a hand-written loop, Lightning and Trainer: the evaluation loader's
    iterator draws its seed from the global generator, and the run's later shuffles and
    augmentations follow from there), ``at_end``: evaluate after the run's last update too
    when it falls off the ``every`` cadence (Trainer's rule; True by default)."""

    data: Optional[object] = None
    every: Optional[int] = None
    metrics: Optional[Mapping[str, Callable]] = None
    ema: bool = False
    every_epochs: Optional[int] = None
    draws: str = "restore"
    at_end: bool = True

    FLAT: ClassVar[dict] = {"data": "eval_data", "every": "eval_every", "metrics": "eval_metrics", "ema": "eval_ema",
                            "every_epochs": "eval_every_epochs", "draws": "eval_draws", "at_end": "eval_at_end"}
    OP: ClassVar[str] = "EvalOptions"

    def __post_init__(self) -> None:
        op = self.OP
        for name in ("every", "every_epochs"):
            if getattr(self, name) is not None:
                check_count(op, self.FLAT[name], getattr(self, name), 1)
        check_bool(op, "eval_ema", self.ema)
        check_choice(op, "eval_draws", self.draws, EVAL_DRAWS)
        check_bool(op, "eval_at_end", self.at_end)
        check_eval_sets(op, self.data)
        if self.metrics is not None and (
            not isinstance(self.metrics, Mapping) or not all(callable(f) for f in self.metrics.values())
        ):
            raise ConfigError(f"{op}: eval_metrics must map names to callables (output, target) -> tensor")
        for name in self.metrics or {}:
            if not isinstance(name, str) or name in RESERVED:
                raise ConfigError(f"{op}: eval_metrics: {name!r} is not a metric name a loop can log: an evaluation "
                                  f"gives 'loss' and 'items' itself, and the metrics files' records name their "
                                  f"'kind', 'step' and 'epoch' (choose another name)")
        if self.metrics and self.data is None:
            raise ConfigError(f"{op}: eval_metrics needs eval_data")


EVAL_DRAWS = ("restore", "advance")


@dataclass(frozen=True, kw_only=True)
class ParallelOptions:
    """How the ranks share a run under ``torch.distributed`` (see ``LoopOptions``):
    ``sharding``, ``shard_by``, ``exact_reduction``, ``collective_timeout`` (seconds, or
    ``None``: the process group's own), ``replica_check``. Under ``sharding="parameters"``,
    a model built on torch's meta device is filled on each rank, its own ranges only, unit
    by unit: ``init_weights`` (a function called on every module in ``module.apply``'s
    order, or ``"reset_parameters"``: each module's own) and/or ``init_from`` (a weights
    file or Hugging Face folder, read by name after ``init_weights``); ``gather_at_end``:
    the module gathered whole when the run ends (``None``: when it started whole; a run
    started on meta ends with its result in its sharded checkpoint, the module released).
    ``item_seeds``: ``False`` (the default): every item draws the random numbers (dropout)
    it draws in one process, on any number of ranks, the plain loop's numbers: a rank runs
    its own items' forwards only, each started where one process starts it (the update's
    generator state moved ahead by the earlier items' draws, counted once per item shape,
    ``runner/draw_shift.py``); ``True``: each item draws from a generator of its own,
    seeded by one draw of the run's generator per update and the item's index (other
    numbers than the plain loop's, alike on any number of ranks). ``shard_units``: module classes whose
    instances are each gathered whole for their forward and backward under ``"parameters"``
    (FSDP2's ``fully_shard`` on each transformer block): fewer, larger gathers than one per
    module holding parameters, for one block's memory at a time (``None``: every element of
    an ``nn.ModuleList``, as a transformer's blocks; ``()``: every module holding parameters
    its own unit)."""

    sharding: Optional[str] = None
    shard_by: str = "range"
    exact_reduction: bool = False
    collective_timeout: Optional[float] = 300.0
    replica_check: bool = True
    init_weights: Union[None, str, Callable] = None
    init_from: Optional[PathArg] = None
    gather_at_end: Optional[bool] = None
    item_seeds: bool = False
    shard_units: Optional[tuple] = None

    FLAT: ClassVar[dict] = {"sharding": "sharding", "shard_by": "shard_by", "exact_reduction": "exact_reduction",
                            "collective_timeout": "collective_timeout", "replica_check": "replica_check",
                            "init_weights": "init_weights", "init_from": "init_from",
                            "gather_at_end": "gather_at_end", "item_seeds": "item_seeds", "shard_units": "shard_units"}
    OP: ClassVar[str] = "ParallelOptions"

    def __post_init__(self) -> None:
        op = self.OP
        check_bool(op, "replica_check", self.replica_check)
        check_bool(op, "exact_reduction", self.exact_reduction)
        t = self.collective_timeout
        if t is not None and not (isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < 10**7):
            raise ConfigError(f"{op}: collective_timeout must be seconds > 0 (below 10**7) or None, got {t!r}")
        if self.sharding is not None and self.sharding not in SHARDING_MODES:
            raise ConfigError(f"{op}: sharding must be one of {SHARDING_MODES} or None, got {self.sharding!r}")
        check_choice(op, "shard_by", self.shard_by, SHARD_BY)
        w = self.init_weights
        if not (w is None or w == "reset_parameters" or callable(w) and not isinstance(w, str)):
            raise ConfigError(f"{op}: init_weights must be a function of a module, 'reset_parameters' or None, "
                              f"got {w!r:.60}")
        if self.init_from is not None and not isinstance(self.init_from, (str, os.PathLike)):
            raise ConfigError(f"{op}: init_from must be a path or None, got {type(self.init_from).__name__}")
        for name in ("gather_at_end", "item_seeds"):
            if getattr(self, name) is not None:
                check_bool(op, name, getattr(self, name))
        units = self.shard_units
        if units is not None and not (isinstance(units, (tuple, list)) and all(
                isinstance(u, type) and issubclass(u, nn.Module) for u in units)):
            raise ConfigError(f"{op}: shard_units must be a tuple of torch.nn.Module classes (e.g. your transformer "
                              f"block's), got {units!r:.60}")
        for name in ("init_weights", "init_from", "gather_at_end", "shard_units"):
            if getattr(self, name) is not None and self.sharding != "parameters":
                raise ConfigError(f"{op}: {name} is for sharding='parameters' (a model filled and kept in ranges "
                                  f"per rank), got sharding={self.sharding!r}")


RECORDS = {"checkpoints": CheckpointOptions, "evaluation": EvalOptions, "parallel": ParallelOptions}


def group(op: str, cfg, given: dict) -> None:
    """Fill ``cfg``'s flat fields from the records ``given`` (name -> record or ``None``),
    then build every record from the flat fields (each checks itself) and set it on
    ``cfg`` (a frozen dataclass). A setting given both ways, with two values, is refused."""
    flat = {f.name: f for f in dataclasses.fields(cfg)}
    for name, kind in RECORDS.items():
        record = given.get(name)
        if record is None or getattr(record, "_derived", False):  # None, or a config's own (replace)
            continue
        if not isinstance(record, kind):
            raise ConfigError(f"{op}: {name} must be a leantrain {kind.__name__}, got {type(record).__name__}")
        for field, attr in kind.FLAT.items():
            if attr not in flat:  # eval_every_epochs: loaders only
                if getattr(record, field) is not None:
                    raise ConfigError(f"{op}: {name}.{field} is for loader loops (LoaderTrainConfig)")
                continue
            mine, theirs, default = getattr(cfg, attr), getattr(record, field), flat[attr].default
            if mine is not default and mine != default and mine != theirs:
                raise ConfigError(f"{op}: {attr}={mine!r} and {name}.{field}={theirs!r}: give it one way")
            object.__setattr__(cfg, attr, theirs)
    for name, kind in RECORDS.items():
        values = {field: getattr(cfg, attr) for field, attr in kind.FLAT.items() if attr in flat}
        try:
            record = kind(**values)
        except ConfigError as e:  # say it as the config's own check
            raise ConfigError(str(e).replace(f"{kind.OP}: ", f"{op}: ", 1)) from None
        object.__setattr__(record, "_derived", True)  # built from the flat fields: no news of its own
        object.__setattr__(cfg, name, record)
