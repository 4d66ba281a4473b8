"""The run's checkpoints, whole: the ``Checkpointer`` a session calls, as torchtitan's loop
calls its checkpointer.

It owns where checkpoints go (checked when the run starts, before anything is read or
written there; the destination locked for this run, ``io/run_lock.py``), whether and
from what the run resumes (``resume_from``, ``"auto"`` resolved; the file checked
against the run before anything is installed), its cadence (every ``checkpoint_every``
updates, when the run is asked to stop, after each evaluation when keeping the best,
and at the end), the folder of kept checkpoints and its pruning
(``checkpoint_folder.py``), and the best checkpoint, loaded at the end only once
proven to be the file this run wrote.

A checkpoint's progress record is the loop's position (the update, and a loader's
epoch, batch and items seen), what the run must match on resume (``expect``), the run's
record (losses, evaluations, norms), the callbacks' states, the loss scale, the run's
id and, per file, a random file id (the identity the kept folder checks, written in the
manifest's ``identity``, beside the progress).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar, Optional, Sequence, Union

from ...errors import CheckpointError, ConfigError, LeantrainError
from ...io.atomic import remove_dead_scratch
from ...io.checkfile import read_manifest
from ...io.checkpoint import check_destination
from ...io.loading import Checkpoint, load_checkpoint
from ...io.run_lock import RunLock, lock_path
from ...io.sharded import check_folder
from ...optim import OptState, Optimizer
from ...params.meta import unfilled_outside
from ...optim.optimizer import GENERIC, NATIVE
from ...validate import check_bool, check_choice, check_count
from ..parallel.strategy import Strategy
from ..runner.precision import LossScaler
from ..runner.runner import Runner
from .callbacks import Callback
from .checkpoint_checks import check_savable, restore_callbacks, resume_check, stateful
from .checkpoint_folder import CheckpointFolder, check_template, file_id_of, newest_whole, resume_path, template_fields
from .record import RunRecord

Log = Callable[[str], None]
PathArg = Union[str, os.PathLike]


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """The ``Checkpointer``'s settings (a loop config's ``checkpoints``; each also a keyword
    of the config: ``checkpoint_path``, ``checkpoint_every``, the others by their own
    names): where and when checkpoints are written and what a run resumes from.

    ``path``: the checkpoint (a file replaced at each save; ``{step}`` in its name keeps
    a folder of files, see ``checkpoint_folder.py``); ``every``: save every N updates
    (and at the end); ``resume_from``: continue exactly from a checkpoint (``"auto"``:
    from ``path`` when one exists there, else start fresh); ``keep_last``/``keep_best``:
    the folder keeps the newest K / the best K by ``monitor`` (an evaluation result) and
    ``mode``; ``load_best_at_end``: the best one's parameters back in the model at the end."""

    path: Optional[PathArg] = field(default=None, metadata={"flat": "checkpoint_path"})
    every: int = field(default=0, metadata={"flat": "checkpoint_every"})
    resume_from: Optional[PathArg] = None
    keep_last: Optional[int] = None
    keep_best: Optional[int] = None
    monitor: str = "loss"
    mode: str = "min"
    load_best_at_end: bool = False

    OP: ClassVar[str] = "CheckpointOptions"

    def __post_init__(self) -> None:
        op = self.OP
        for name in ("path", "resume_from"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                flat = "checkpoint_path" if name == "path" else name
                raise ConfigError(f"{op}: {flat} must be a path or None, got {type(value).__name__}")
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


def uses_native(runner: Runner, opt: Optimizer) -> bool:
    """The loop's path, decided once: native when the optimizer has one and the
    parameters live on device mirrors; never switched mid-run (not even for a short
    last batch), so one history stays on one path."""
    return opt.native and runner.params.has_mirrors()


class Checkpointer:
    """The checkpoints of one run of a ``kind`` loop (``"samples"`` or ``"loader"``) with
    ``settings``. ``record``: the run's record (saved in every progress, taken back on
    resume); ``callbacks``: the run's (their states saved); ``scaler``: float16's loss
    scale; ``run``: what every checkpoint carries of the run's other settings and must
    match on resume (``ema_decay``, ``autocast``, ``seed``), ``averaging`` (its averaged
    model saved too) and ``sharded`` (a sharded run saves a folder); ``span(name)``: the
    profiler's range around a save. The session calls six members: ``start``, ``turn``,
    ``finish``, ``load_best``, ``close`` and ``last``."""

    def __init__(self, op: str, settings: CheckpointOptions, strategy: Strategy, kind: str, record: RunRecord,
                 callbacks: Sequence[Callback], scaler: Optional[LossScaler], log: Log, *, run: dict,
                 averaging=None, sharded: bool = False, span=None) -> None:
        self.op, self.settings, self.strategy, self.kind = op, settings, strategy, kind
        self.record, self.callbacks, self.scaler, self.log = record, callbacks, scaler, log
        self.run, self.averaging, self.sharded = run, averaging, sharded
        self.span = span if span is not None else (lambda name: contextlib.nullcontext())
        self.path = settings.path
        # A folder of checkpoints ({step} in checkpoint_path): each save a new file, pruned.
        self.folder = CheckpointFolder(op, settings) if template_fields(self.path) else None
        self.expect: dict = {}  # what a resume must match; saved in every progress
        self.resume_from: Optional[Path] = None
        self.run_id: Optional[str] = None
        self.legacy = False  # resumed from a checkpoint written before runs had ids
        self.lock: Optional[RunLock] = None
        self.pending: Optional[tuple[dict, OptState, object]] = None  # the newest update's
        self.saved = True  # whether ``pending`` is on disk
        self.saved_step: Optional[int] = None  # the update of the newest checkpoint written
        self.saved_path = self.path  # and its file
        self.nonce, self.saves = "", 0  # this start's seed of its files' ids, the files written since

    # ------------------------------------------------------------------ start
    def start(self, runner: Runner, opt: Optimizer, expect: dict, agree: dict, loader_check=None
              ) -> Optional[Checkpoint]:
        """Check where checkpoints go, resolve the resume, take the destination's lock; every
        rank agrees on the run (``Strategy.agree_on_start``: ``expect``, whether it resumes,
        ``agree``, and why this run cannot write there, raised on every rank). Then the
        checkpoint the run resumes from, read and checked before anything is installed, its
        records taken back (``None``: a fresh run; nothing of the runner changed)."""
        refused = self._prepare(expect)
        self.strategy.agree_on_start(self.op, dict(self.expect, resume=self.resume_from is not None,
                                                   refused=refused, **agree))
        if self.resume_from is None:
            return None
        ck = self._load(runner, opt, loader_check)
        self._restore(ck)
        return ck

    def _prepare(self, expect: dict) -> Optional[str]:
        """Where checkpoints go, checked; the resume resolved; the lock taken. Returns why
        this run cannot write there (``None``: it can)."""
        check_savable(self.op, self.callbacks)  # before the first update, not at the first save
        settings = self.settings
        if self.folder is not None:
            check_destination(self.op, self.folder.path_for(0, 0, None))
        elif self.path is not None and not self.sharded:
            check_destination(self.op, self.path)  # a folder is refused now, not at the first save
        elif self.path is not None:
            check_folder(self.op, self.path)  # a sharded run saves a folder
        self.expect = dict(expect, ema_decay=self.run["ema_decay"], autocast=self.run["autocast"])
        self.strategy.check_shared(self.op, self.path)  # before any rank looks for a checkpoint
        self.resume_from = resume_path(settings, self.folder)
        if self.resume_from is not None and settings.resume_from == "auto":
            self.log(f"{self.op}: resuming from {self.resume_from}")
        saved_id = self._run_id_of(self.resume_from)
        # One job, one identity: rank 0's run id (a resume continues its run) and its files' id seed on every rank.
        self.run_id, self.nonce = self.strategy.from_main((saved_id or uuid.uuid4().hex[:16], uuid.uuid4().hex))
        self.legacy = self.resume_from is not None and saved_id is None  # its files carry no run id
        if self.path is None or not self.strategy.main:
            return None
        folder = self.folder is not None
        where = Path(self.path).parent if folder else Path(self.path)
        self.lock = RunLock(lock_path(where, folder), self.run_id)
        refused = self.lock.acquire(self.op, str(where))
        if refused is None and folder:
            refused = self._foreign_files()
            if refused is not None:
                self.close()
            else:  # each kept file has its own scratch name: a killed save's is cleaned by no later save of it
                remove_dead_scratch(self.folder.folder)
        return refused

    def _run_id_of(self, path: Optional[Path]) -> Optional[str]:
        """The run id a resumed checkpoint records (``None``: none, or no resume; the load reports a bad file)."""
        try:
            return None if path is None or Path(path).is_dir() else run_of(read_manifest(path, self.op))
        except CheckpointError:
            return None

    def _foreign_files(self) -> Optional[str]:
        """Why this run's kept folder is not its own: files its template names that read as
        checkpoints of another run, which its saves could replace (``None``: none)."""
        folder = self.folder
        if not folder.folder.is_dir():
            return None
        others = []
        for p in sorted(folder.folder.iterdir()):
            if not folder.pattern.fullmatch(p.name) or not p.is_file():
                continue
            try:
                run = run_of(read_manifest(p, self.op))
            except CheckpointError:
                continue  # not a checkpoint of anyone's: torn, or not ours to judge
            if run != self.run_id and not (run is None and self.legacy):
                others.append(f"{p.name} (run {run})" if run else p.name)
        if not others:
            return None
        return (f"{self.op}: {folder.folder} holds checkpoints of another run ({', '.join(others[:4])}"
                f"{', ...' if len(others) > 4 else ''}); this run ({self.run_id}) would replace or prune them: "
                f"resume that run (resume_from='auto'), give this run its own folder, or move them away")

    def _load(self, runner: Runner, opt: Optimizer, loader_check=None) -> Checkpoint:
        """Read the checkpoint the run resumes from; whether it fits this run (its kind,
        ``expect``, the update path, the kept-files record, ``loader_check``) is decided
        before anything is installed."""
        want_path = NATIVE if uses_native(runner, opt) else GENERIC
        extra = [loader_check] if loader_check is not None else []
        if self.folder is not None:
            extra.append(lambda manifest, tensors: self.folder.problems(manifest["progress"].get("checkpoints", [])))
        if runner.unfilled:  # a model built on meta: the checkpoint must fill every tensor it has
            extra.append(lambda manifest, tensors: unfilled_outside(runner))
        fits = resume_check(self.kind, self.expect, self.run["ema_decay"], self.averaging, want_path,
                            self.scaler is not None, extra)
        ck = load_checkpoint(self.resume_from, runner, optimizer=opt, accept=fits, follow_trainable=True,
                             host_state=self.strategy.host_state,  # sharding moves its ranges only
                             wanted=self.strategy.resume_ranges(runner))
        self.strategy.resumed(runner, ck.ranged)
        return ck

    def _restore(self, ck: Checkpoint) -> None:
        """Take back what a resumed checkpoint carries besides the parameters and the
        optimizer: the loss scale, the callbacks' states, the kept files, the record."""
        p = ck.progress
        if self.scaler is not None:
            self.scaler.scale.fill_(p["loss_scale"])
            self.scaler.tracker.fill_(p["scale_tracker"])
        restore_callbacks(self.op, self.callbacks, p.get("callbacks", []))
        if self.averaging is not None:
            self.averaging.load(self.op, ck.averaged)
        if self.folder is not None:
            self.folder.resume(p.get("checkpoints", []), p.get("checkpoint_folder"))
        self.record.resume(p)

    # ---------------------------------------------------------------- cadence
    def turn(self, runner: Runner, progress: dict, state: OptState, loader_state, *, stop: bool = False,
             evaluated: bool = False, epoch_end: bool = False, decide=None) -> bool:
        """The checkpoints' turn after an update (``progress``: its position) or, with
        ``epoch_end``, after a loader epoch's end: the newest update held (``loader_state``
        may be a function asked only when a file is written) and written when due: on the
        ``every`` cadence (after an update), after each evaluation when keeping the best (to
        be ranked), then, once ``decide(stop)`` gave the job's answer (this rank's ``stop``
        shared by every rank), when the run stops. The cadence's file is written before that
        decision, so a peer lost there leaves it. A checkpoint written after an epoch's end
        says so (a resume from it does not run that end again; one from an earlier file
        does). Returns the job's answer: stop."""
        if epoch_end:
            progress = dict(progress, epoch_end=True)
            if self.pending is not None and self.pending[0]["step"] == progress["step"]:
                self.pending = (dict(self.pending[0], epoch_end=True), *self.pending[1:])
            else:  # a resumed run at its checkpoint's epoch end: nothing new since that file
                self.pending = (progress, state, loader_state)
        else:
            self.pending, self.saved = (progress, state, loader_state), False
        every = 0 if epoch_end else self.settings.every
        due = (evaluated and self.settings.keep_best is not None) or bool(every and progress["step"] % every == 0)
        if self.path and due:
            with self.span("leantrain.checkpoint"):
                self.save(runner)
        if decide is not None:
            stop = decide(stop)
        if self.path and stop and not self.saved:
            with self.span("leantrain.checkpoint"):
                self.save(runner)
        return stop

    def save(self, runner: Runner) -> None:
        """Write the newest update's checkpoint (the strategy says which ranks write)."""
        if self.pending is None:
            return
        if runner.params.has_mirrors():
            runner.recheck()  # saving syncs mirrors to the host: check again at the next step
        progress, state, loader_state = self.pending
        step, path = progress["step"], self.path
        file_id = file_id_of(self.nonce, self.saves)  # alike on every rank, new for every file
        self.saves += 1
        kept = {}
        if self.folder is not None:
            metric = self.record.metric_at(step, self.settings.monitor)
            path = self.folder.path_for(step, progress.get("epoch"), metric)
            kept = {"checkpoints": self.folder.record(path, step, metric, self.run_id, file_id),
                    "checkpoint_folder": self.folder.where()}
        try:
            averaged = {} if self.averaging is None else {"averaged": self.averaging.tensors()}
            self.strategy.save(path, runner, state, dict(self._progress(progress), **kept), loader_state,
                               runner.ema if self.run["ema_decay"] is not None else None,
                               {"run": self.run_id, "file": file_id}, **averaged)
        except LeantrainError:
            raise
        except Exception as e:  # a peer lost inside a sharded save: a CollectiveError naming what survives
            self.strategy.failed(self.op, e, f"saving the checkpoint of update {step}", self.last())
        if self.folder is not None:
            self.folder.written(path, kept["checkpoints"], self.strategy.main)
            if self.settings.keep_best is not None and self.settings.load_best_at_end:
                self.folder.check_best(self._best_problem())  # said now, not after training on to the end
        self.saved, self.saved_step, self.saved_path = True, step, path

    def _progress(self, progress: dict) -> dict:
        """A checkpoint's progress record: the update's, with the run's history."""
        states = [[type(cb).__name__, cb.state_dict()] for cb in stateful(self.callbacks)]
        return dict(self.expect, **progress, kind=self.kind, seed=self.run["seed"], **self.record.progress(),
                    **({"callbacks": states} if states else {}), **(self.scaler.state() if self.scaler is not None else {}))

    def last(self) -> str:
        """The newest checkpoint written, for error messages."""
        return f"{self.saved_path} (step {self.saved_step})" if self.saved_step is not None else "none saved yet"

    # -------------------------------------------------------------------- end
    def finish(self, runner: Runner) -> None:
        """The final checkpoint, unless the newest update is saved."""
        if self.path and not self.saved:
            self.save(runner)

    def load_best(self, runner: Runner) -> Optional[Path]:
        """The best checkpoint kept (``keep_best``; ``None`` without one), proven to be the
        file this run wrote; with ``load_best_at_end`` its parameters put in the model (a
        best that is no longer this run's file is a ``CheckpointError``, not a silent load)."""
        settings, folder = self.settings, self.folder
        if folder is None or settings.keep_best is None:
            return None
        entry = folder.best_entry()
        if entry is None:
            if settings.load_best_at_end:
                warnings.warn(f"{self.op}: load_best_at_end: no evaluation gave a finite {settings.monitor!r}, so no "
                              f"checkpoint ranks as the best; the model keeps its final weights", stacklevel=4)
            return None
        best = folder.folder / entry[0]
        why = self._best_problem()
        if settings.load_best_at_end:
            folder.check_best(why)
            load_checkpoint(best, runner, restore_rng=False)  # the best parameters, nothing else
        elif why is not None:
            if self.strategy.main:
                warnings.warn(f"{self.op}: the best checkpoint kept: {why}; the report names no best", stacklevel=4)
            return None
        return best

    def _best_problem(self) -> Optional[str]:
        """Why the best kept file is not this run's: proven where it was written (rank 0), the
        verdict shared, so every rank loads the same file or none."""
        try:
            return self.strategy.from_main(self.folder.best_problem() if self.strategy.main else None)
        except Exception as e:  # a peer lost: a CollectiveError naming where and the last checkpoint
            self.strategy.failed(self.op, e, "sharing the best checkpoint's check", self.last())

    def close(self) -> None:
        """Give the destination's lock back (the run ended, well or not)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def run_of(manifest: dict) -> Optional[str]:
    """The run a checkpoint's manifest says wrote it (``None``: written before runs had ids)."""
    identity = manifest.get("identity")
    return identity.get("run") if isinstance(identity, dict) else None


def resumed(ck: Checkpoint) -> Checkpoint:
    """What the loops keep of a resumed checkpoint: its progress and loader position; the
    whole optimizer state and moving average it read are dropped (a sharded rank keeps its
    ranges, not +2x the weights)."""
    return dataclasses.replace(ck, state=None, ema=None)


__all__ = ["CheckpointOptions", "Checkpointer", "newest_whole", "uses_native"]
