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

import dataclasses
import json
import uuid
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

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
from ...validate import is_int, is_number
from ..parallel.strategy import Strategy
from ..runner.precision import LossScaler, scaler_state_problems
from ..runner.runner import Runner
from .callbacks import Callback
from .checkpoint_folder import CheckpointFolder, file_id_of, newest_whole, resume_path, template_fields
from .record import RunRecord

Log = Callable[[str], None]

# What a checkpoint written before a setting existed implies for it.
EXPECT_DEFAULTS = {"accumulate": 1, "ema_decay": None, "autocast": None}


def uses_native(runner: Runner, opt: Optimizer) -> bool:
    """The loop's path, decided once: native when the optimizer has one and the
    parameters live on device mirrors; never switched mid-run (not even for a short
    last batch), so one history stays on one path."""
    return opt.native and runner.params.has_mirrors()


class Checkpointer:
    """The checkpoints of one run of a ``kind`` loop (``"samples"`` or ``"loader"``).
    ``record``: the run's record (saved in every progress, taken back on resume);
    ``callbacks``: the run's (their states saved); ``scaler``: float16's loss scale."""

    def __init__(self, op: str, cfg, strategy: Strategy, kind: str, record: RunRecord,
                 callbacks: Sequence[Callback], scaler: Optional[LossScaler], log: Log) -> None:
        self.op, self.cfg, self.strategy, self.kind = op, cfg, strategy, kind
        self.record, self.callbacks, self.scaler, self.log = record, callbacks, scaler, log
        self.path = cfg.checkpoint_path
        # A folder of checkpoints ({step} in checkpoint_path): each save a new file, pruned.
        self.folder = CheckpointFolder(op, cfg) if template_fields(self.path) else None
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
    def start(self, expect: dict) -> Optional[str]:
        """Check where checkpoints go, resolve the resume, take the destination's lock.
        Returns why this run cannot write there (``None``: it can); the strategy makes
        every rank raise it (``Strategy.agree_on_start``)."""
        check_savable(self.op, self.callbacks)  # before the first update, not at the first save
        cfg = self.cfg
        if self.folder is not None:
            check_destination(self.op, self.folder.path_for(0, 0, None))
        elif self.path is not None and cfg.sharding is None:
            check_destination(self.op, self.path)  # a folder is refused now, not at the first save
        elif self.path is not None:
            check_folder(self.op, self.path)  # a sharded run saves a folder
        self.expect = dict(expect, ema_decay=cfg.ema_decay, autocast=cfg.autocast)
        self.strategy.check_shared(self.op, self.path)  # before any rank looks for a checkpoint
        self.resume_from = resume_path(cfg, self.folder)
        if self.resume_from is not None and cfg.resume_from == "auto":
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

    def load(self, runner: Runner, opt: Optimizer, loader_check=None) -> Checkpoint:
        """Read the checkpoint the run resumes from; whether it fits this run (its kind,
        ``expect``, the update path, the kept-files record, ``loader_check``) is decided
        before anything is installed."""
        want_path = NATIVE if uses_native(runner, opt) else GENERIC
        extra = [loader_check] if loader_check is not None else []
        if self.folder is not None:
            extra.append(lambda manifest, tensors: self.folder.problems(manifest["progress"].get("checkpoints", [])))
        if runner.unfilled:  # a model built on meta: the checkpoint must fill every tensor it has
            extra.append(lambda manifest, tensors: unfilled_outside(runner))
        fits = resume_check(self.kind, self.cfg, self.expect, want_path, self.scaler is not None, extra)
        ck = load_checkpoint(self.resume_from, runner, optimizer=opt, accept=fits, follow_trainable=True,
                             host_state=self.strategy.host_state,  # sharding moves its ranges only
                             wanted=self.strategy.resume_ranges(runner, self.cfg))
        self.strategy.resumed(runner, ck.ranged)
        return ck

    def restore(self, ck: Checkpoint) -> None:
        """Take back what a resumed checkpoint carries besides the parameters and the
        optimizer: the loss scale, the callbacks' states, the kept files, the record."""
        p = ck.progress
        if self.scaler is not None:
            self.scaler.scale.fill_(p["loss_scale"])
            self.scaler.tracker.fill_(p["scale_tracker"])
        restore_callbacks(self.op, self.callbacks, p.get("callbacks", []))
        if self.cfg.averaging is not None:
            self.cfg.averaging.load(self.op, ck.averaged)
        if self.folder is not None:
            self.folder.resume(p.get("checkpoints", []), p.get("checkpoint_folder"))
        self.record.resume(p)

    # ---------------------------------------------------------------- cadence
    def hold(self, progress: dict, state: OptState, loader_state) -> None:
        """The newest update's progress and state, saved when due (``loader_state`` may be
        a function asked only when a file is written)."""
        self.pending, self.saved = (progress, state, loader_state), False

    def epoch_ended(self, progress: dict, state: OptState, loader_state) -> None:
        """The newest update's epoch has ended: a checkpoint written from now on says so (a
        resume from it does not run that end again; one from an earlier file does)."""
        progress = dict(progress, epoch_end=True)
        if self.pending is not None and self.pending[0]["step"] == progress["step"]:
            self.pending = (dict(self.pending[0], epoch_end=True), *self.pending[1:])
        else:  # a resumed run at its checkpoint's epoch end: nothing new since that file
            self.pending = (progress, state, loader_state)

    def due(self, step: int, stop: bool, evaluated: bool) -> bool:
        """Whether update ``step`` is saved: on the ``checkpoint_every`` cadence, when the
        run stops, and after each evaluation when keeping the best (to be ranked)."""
        cfg = self.cfg
        if not self.path:
            return False
        every = cfg.checkpoint_every
        return stop or (evaluated and cfg.keep_best is not None) or bool(every and step % every == 0)

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
            metric = self.record.metric_at(step, self.cfg.monitor)
            path = self.folder.path_for(step, progress.get("epoch"), metric)
            kept = {"checkpoints": self.folder.record(path, step, metric, self.run_id, file_id),
                    "checkpoint_folder": self.folder.where()}
        try:
            averaged = {} if self.cfg.averaging is None else {"averaged": self.cfg.averaging.tensors()}
            self.strategy.save(path, runner, state, dict(self._progress(progress), **kept), loader_state,
                               runner.ema if self.cfg.ema_decay is not None else None,
                               {"run": self.run_id, "file": file_id}, **averaged)
        except LeantrainError:
            raise
        except Exception as e:  # a peer lost inside a sharded save: a CollectiveError naming what survives
            self.strategy.failed(self.op, e, f"saving the checkpoint of update {step}", self.last())
        if self.folder is not None:
            self.folder.written(path, kept["checkpoints"], self.strategy.main)
            if self.cfg.keep_best is not None and self.cfg.load_best_at_end:
                self.folder.check_best(self._best_problem())  # said now, not after training on to the end
        self.saved, self.saved_step, self.saved_path = True, step, path

    def _progress(self, progress: dict) -> dict:
        """A checkpoint's progress record: the update's, with the run's history."""
        states = [[type(cb).__name__, cb.state_dict()] for cb in stateful(self.callbacks)]
        return dict(self.expect, **progress, kind=self.kind, seed=self.cfg.seed, **self.record.progress(), **({"callbacks": states} if states else {}),
                    **(self.scaler.state() if self.scaler is not None else {}))

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
        cfg, folder = self.cfg, self.folder
        if folder is None or cfg.keep_best is None:
            return None
        entry = folder.best_entry()
        if entry is None:
            if cfg.load_best_at_end:
                warnings.warn(f"{self.op}: load_best_at_end: no evaluation gave a finite {cfg.monitor!r}, so no "
                              f"checkpoint ranks as the best; the model keeps its final weights", stacklevel=4)
            return None
        best = folder.folder / entry[0]
        why = self._best_problem()
        if cfg.load_best_at_end:
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
        return self.strategy.from_main(self.folder.best_problem() if self.strategy.main else None)

    def close(self) -> None:
        """Give the destination's lock back (the run ended, well or not)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def run_of(manifest: dict) -> Optional[str]:
    """The run a checkpoint's manifest says wrote it (``None``: written before runs had ids)."""
    identity = manifest.get("identity")
    return identity.get("run") if isinstance(identity, dict) else None


# ----------------------------------------------------------------- checks
def check_savable(op: str, callbacks: Sequence[Callback]) -> None:
    """Each callback's saved state is JSON data (a checkpoint's progress holds it): checked
    when the loop starts, so a tensor in it is refused before the first update, not at
    the first save."""
    for cb in callbacks:
        state = cb.state_dict()
        if state is None:
            continue
        try:
            json.dumps(state, allow_nan=True)
        except (TypeError, ValueError, RecursionError) as e:
            raise ConfigError(f"{op}: {type(cb).__name__}.state_dict() is not JSON data ({e}); a checkpoint saves "
                              f"it as JSON: return numbers, strings, lists and dicts (float(t) for a tensor "
                              f"t)") from None


def restore_callbacks(op: str, callbacks: Sequence[Callback], saved: list) -> None:
    """Give the callbacks that keep state theirs back (the same kinds in the same order
    as when saved); otherwise say that they start afresh."""
    mine = stateful(callbacks)
    kinds = [type(cb).__name__ for cb in mine]
    if kinds == [kind for kind, _ in saved]:
        for cb, (_, state) in zip(mine, saved):
            cb.load_state_dict(state)
    elif saved or mine:
        warnings.warn(f"{op}: the checkpoint carries the state of the callbacks {[k for k, _ in saved]}, this "
                      f"run's callbacks keeping state are {kinds}: they start afresh", stacklevel=6)


def stateful(callbacks: Sequence[Callback]) -> list[Callback]:
    """The callbacks that carry state across a resume (``state_dict()`` is not None)."""
    return [cb for cb in callbacks if cb.state_dict() is not None]


def progress_problems(kind: str, p: dict) -> list[str]:
    """Why a saved progress record cannot resume a ``kind`` loop: each field it needs,
    of the wrong type or out of range."""
    out = []
    counts = ("step",) + (("epoch", "batch", "seen") if kind == "loader" else ())
    for key in counts:
        v = p.get(key)
        if not (is_int(v) and 0 <= v < 2**63):
            out.append(f"progress.{key}: expected an integer >= 0, got {v!r}")
    if p.get("before") is not None and not is_number(p.get("before")):
        out.append(f"progress.before: expected a number or null, got {p.get('before')!r}")
    for key in ("losses", "grad_norms"):
        pairs = p.get(key, [] if key == "grad_norms" else None)
        if not (isinstance(pairs, list) and all(
                isinstance(x, list) and len(x) == 2 and is_int(x[0]) and is_number(x[1]) for x in pairs)):
            out.append(f"progress.{key}: expected a list of [step, value] pairs")
    saved = p.get("callbacks", [])
    if not (isinstance(saved, list) and all(
            isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], dict) for x in saved)):
        out.append("progress.callbacks: expected a list of [callback kind, state] pairs")
    evals = p.get("evals", [])
    if not (isinstance(evals, list) and all(
            isinstance(x, list) and len(x) == 2 and is_int(x[0]) and isinstance(x[1], dict) for x in evals)):
        out.append("progress.evals: expected a list of [step, results] pairs")
    if p.get("checkpoint_folder") is not None and not isinstance(p.get("checkpoint_folder"), str):
        out.append(f"progress.checkpoint_folder: expected a string, got {p.get('checkpoint_folder')!r:.40}")
    return out


def resume_check(kind: str, cfg, expect: dict, want_path: str, scaling: bool, extra: list):
    """``accept(manifest, tensors)`` for ``load_checkpoint``: why a checkpoint cannot resume
    this ``kind`` of loop (its progress, ``expect``, the moving average, the update path,
    the float16 loss scale when ``scaling``, and each of ``extra``'s problems), decided
    before anything is installed."""
    def fits(manifest: dict, tensors: dict) -> list[str]:
        p = manifest.get("progress") or {}
        if not isinstance(p, dict) or p.get("kind") != kind or not manifest.get("optimizer"):
            return [f"not a {kind} training checkpoint with optimizer state"]
        problems = progress_problems(kind, p)
        if scaling and p.get("autocast") == "float16":
            problems += scaler_state_problems(p)
        problems += [f"{key}: checkpoint has {p.get(key, EXPECT_DEFAULTS.get(key))!r}, this run has {value!r}"
                     for key, value in expect.items() if p.get(key, EXPECT_DEFAULTS.get(key)) != value]
        e = manifest.get("ema")
        if cfg.ema_decay is not None and (e is None or e["decay"] != cfg.ema_decay):
            problems.append(f"ema: checkpoint has {None if e is None else e['decay']!r}, "
                            f"this run has ema_decay={cfg.ema_decay!r}")
        if cfg.averaging is not None and manifest.get("averaged") is None:
            problems.append("averaged: the checkpoint keeps no averaged model, this run has averaging")
        elif cfg.averaging is not None and not cfg.averaging.fits(
                {name: tensors[f"averaged.{name}"] for name in manifest["averaged"] if f"averaged.{name}" in tensors}):
            problems.append("averaged: the checkpoint's averaged model does not fit this run's AveragedModel "
                            "(names, shapes or dtypes differ)")
        if manifest["optimizer"].get("path") != want_path:
            problems.append(f"the checkpoint's optimizer history is {manifest['optimizer'].get('path')}; "
                            f"resume with parameters on the same kind of device")
        for check in extra:
            problems += check(manifest, tensors)
        return problems

    return fits


def resumed(ck: Checkpoint) -> Checkpoint:
    """What the loops keep of a resumed checkpoint: its progress and loader position; the
    whole optimizer state and moving average it read are dropped (a sharded rank keeps its
    ranges, not +2x the weights)."""
    return dataclasses.replace(ck, state=None, ema=None)


__all__ = ["Checkpointer", "newest_whole", "resume_check", "progress_problems", "uses_native"]
