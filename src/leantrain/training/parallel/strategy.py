"""The run-level ``Strategy``: how the processes of a run start, save and end it.

Chosen once when a loop starts (``choose.py``), as Lightning's ``Strategy`` is; the
session and its components call it and never ask which one they got. It owns the
update's seam, ``strategy.reduction`` (``update/reduction.py``: what one update calls),
and everything else that differs between one process, data parallel and sharding:

* the start: every rank agrees on the run (``agree_on_start``), sees the checkpoint
  folder (``check_shared``), holds the same parameters (``start_replicas``), and gets its
  optimizer history (``start``) and moving average (``ema``);
* around each update: the checks a rank makes before it (``before_update``) and the guard
  around the model's calls (``guard``), where ``watches_updates`` says there are any;
* between updates: the context the user's code runs in (``user_code``), a checkpoint
  written (``save``), a measured loss (``mean_loss``), the job's decisions, taken once
  and shared by every rank (``any_rank``: a stop; ``from_main``: rank 0's value);
* the end: ``finish`` (a run that ended well), ``close`` (any end, the module the user's
  again), ``failed`` (how an error met inside the loop is reported).

``Strategy`` itself is **one process**: nothing to agree, one file per checkpoint.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterable, NoReturn, Optional, Union

from torch import nn

from ...errors import CheckpointError, ConfigError
from ...io.checkpoint import save_checkpoint
from ...optim import OptState, Optimizer
from ..runner.ema import EMA, restored_ema
from ..runner.runner import Runner, Sample
from ..update.reduction import ONE_PROCESS, Reduction
from ...validate import check_bool, check_choice
from .engines import FSDP2, Engine, engine_of, torch_engine
from .sharding.plan import SHARD_BY, SHARDING_MODES

PathArg = Union[str, os.PathLike]

NOTHING = contextlib.nullcontext()  # a context that does nothing (reusable: it keeps no state)


@dataclass(frozen=True, kw_only=True)
class ParallelOptions:
    """The ``Strategy``'s settings: how the ranks share a run under ``torch.distributed``
    (a loop config's ``parallel``; each also a keyword of the config by its own name).

    ``sharding``: ``None`` (every rank holds everything), ``"optimizer"`` (ZeRO stage 1:
    each rank keeps the optimizer state of its ranges only), ``"gradients"`` (stage 2: its
    ranges of the reduced gradient too) or ``"parameters"`` (stage 3: its ranges of the
    parameters too, each module's gathered into its own Parameters around its use);
    ``shard_by``: ``"range"`` (each slot cut at multiples of 64 elements) or ``"slot"``
    (whole slots per rank); ``exact_reduction``: every rank folds all items' gradients in
    item order, so any number of ranks gives the one-process bits (it needs
    ``accumulation="exact"``); ``collective_timeout``: seconds a collective waits for the
    slowest rank before the loop raises ``CollectiveError`` (``None``: the process group's
    own); ``replica_check``: verify that the ranks hold the same parameters at the start. Under ``sharding="parameters"``,
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
    its own unit; with ``engine="fsdp2"``: the modules ``fully_shard`` wraps). ``engine``: ``"leantrain"`` (leantrain's own data parallel and sharding)
    or ``"ddp"`` / ``leantrain.DDP(...)`` (torch's ``DistributedDataParallel`` reduces the
    gradients) or ``"fsdp2"`` / ``leantrain.FSDP2(...)`` (torch's ``fully_shard`` runs the
    forwards and backwards on a sharded working copy, leantrain's optimizer steps the
    shards): ``engines.py``, the loop's contract kept, one process's bits across world
    sizes given up; they take neither ``sharding`` nor ``exact_reduction``."""

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
    engine: Engine = "leantrain"

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
        object.__setattr__(self, "engine", engine_of(op, self.engine))
        if torch_engine(self.engine):
            for name, given in (("exact_reduction", self.exact_reduction), ("sharding", self.sharding)):
                if given:
                    raise ConfigError(f"{op}: {name}={given!r} is leantrain's own engine: it does not run under "
                                      f"engine={self.engine.name!r} (torch's reduction); use engine='leantrain'")
        for name in ("init_weights", "init_from", "gather_at_end", "shard_units"):
            if name == "shard_units" and isinstance(self.engine, FSDP2):
                continue  # the units fully_shard wraps
            if getattr(self, name) is not None and self.sharding != "parameters":
                raise ConfigError(f"{op}: {name} is for sharding='parameters' (a model filled and kept in ranges "
                                  f"per rank), got sharding={self.sharding!r}")

    @property
    def sharded(self) -> bool:
        """Whether the run cuts the optimizer state into ranges and saves a folder
        (``sharding=`` set, or ``engine="fsdp2"``)."""
        return self.sharding is not None or isinstance(self.engine, FSDP2)

    @property
    def cut_by(self) -> str:
        """What cuts the run's state, for messages (``sharding='optimizer'``, ``engine='fsdp2'``)."""
        return f"sharding={self.sharding!r}" if self.sharding is not None else f"engine={self.engine.name!r}"


ONE_PROCESS_SETTINGS = ParallelOptions()


class Strategy:
    """One process (the base every parallel strategy refines)."""

    #: the strategy's name, for messages and the run's report
    name = "one process"
    #: this process logs and writes the run's one-file checkpoints
    main = True
    #: a resumed optimizer state is read into host memory (each rank moves its share)
    host_state = False
    #: the strategy checks each update's batch or guards its model calls (one process: neither)
    watches_updates = False
    #: the run ends with the module whole (parameter sharding may end it released: gather_at_end)
    ends_whole = True
    #: a checkpoint is a folder of every rank's pieces (sharding, engine="fsdp2")
    saves_folder = False

    def __init__(self, reduction: Reduction = ONE_PROCESS, settings: ParallelOptions = ONE_PROCESS_SETTINGS) -> None:
        self.reduction, self.settings = reduction, settings

    # ------------------------------------------------------------------ start

    def resume_ranges(self, runner):
        """What of a resumed checkpoint this process reads (``None``: all of it)."""
        return None

    def resumed(self, runner, ranged: dict) -> None:
        """A resume's load installed the slots (``ranged``: those it handed back instead)."""
        runner.unfilled = {}

    def agree_on_start(self, op: str, what: dict) -> None:
        """Every rank starts the same run, or every rank raises: ``what["refused"]`` (why
        the run cannot start, on the rank that found it) as a ``CheckpointError``, or ranks
        that run different loops (one process: only the refusal)."""
        if what.get("refused"):
            raise CheckpointError(what["refused"])

    def check_shared(self, op: str, checkpoint_path) -> None:
        """Every rank sees where the checkpoints go (one process: nothing to compare)."""
        return None

    def start_replicas(self, op: str, runner: Runner) -> None:
        """The ranks' parameters made alike before the first update (compared first with
        ``replica_check``); a lost peer is reported as ``failed`` says."""
        return None

    def start(self, op: str, runner: Runner, opt: Optimizer, native: bool,
              whole: Optional[OptState] = None) -> OptState:
        """The loop's optimizer history: fresh, or ``whole`` (a resumed checkpoint's)."""
        return whole if whole is not None else opt.init(runner.params, native=native)

    def ema(self, runner: Runner, decay: float, saved=None):
        """The loop's moving average: fresh, or a checkpoint's ``saved`` record."""
        return EMA(runner.params, decay) if saved is None else restored_ema(runner.params, saved)

    # ------------------------------------------------------------- updates
    def before_update(self, op: str, runner: Runner, batch: list) -> None:
        """What is checked before each update (called where ``watches_updates``)."""
        return None

    def guard(self, op: str):
        """A context around a loop's calls of the model (parameter sharding checks them
        until its first update is applied)."""
        return NOTHING

    def user_code(self):
        """A context around the user's code between updates (parameter sharding: the
        parameters whole)."""
        return NOTHING

    def save(self, path, runner: Runner, state: OptState, progress: dict, loader_state, ema,
             identity: Optional[dict] = None, *, averaged: Optional[dict] = None) -> None:
        """Write one checkpoint (``loader_state`` may be a function asked only when a
        file is written; ``identity``: the run's and the file's ids)."""
        if self.main:
            if callable(loader_state):
                loader_state = loader_state()
            save_checkpoint(path, runner, state=state, progress=progress, loader_state=loader_state, ema=ema,
                            identity=identity, averaged=averaged)

    def mean_loss(self, runner: Runner, samples: Iterable[Sample]) -> Optional[float]:
        """A measured mean loss over ``samples`` (this process's)."""
        return runner.mean_loss(samples)

    def any_rank(self, flag: bool) -> bool:
        """One decision for the job (a stop): true on every rank when any rank says so."""
        return flag

    def from_main(self, value):
        """Rank 0's ``value`` on every rank (the run's id, an evaluation's results)."""
        return value

    def total(self, count):
        """A count over the job's data (each rank counted the items it read; one process:
        ``count``)."""
        return count

    # ------------------------------------------------------------------- end
    def finish(self, runner: Runner) -> None:
        """What a run does when its loop ends, before its ``after`` loss."""
        return None

    def close(self, runner: Runner, failed: bool) -> None:
        """The loop ended (``failed``: by an exception): the module as the user owns it."""
        return None

    def failed(self, op: str, e: RuntimeError, where: str, last: str) -> NoReturn:
        """Re-raise a runtime error met inside the loop (one process: as it is)."""
        raise e


ONE_PROCESS_RUN = Strategy()  # a public one-update call's
__all__ = ["ONE_PROCESS", "ONE_PROCESS_RUN", "ParallelOptions", "Strategy"]
