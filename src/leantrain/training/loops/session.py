"""One training run: what the fixed-step and loader loops share.

A ``Session`` starts the run (a fresh optimizer history and the ``before`` loss, or
the state and progress of the checkpoint it resumes from), performs each update (the
loss read back only when a log line is due), hears the callback after each update,
keeps the logged losses and the skip counter, saves checkpoints on their cadence and
when the run stops, and finishes with the ``after`` loss and the ``TrainReport``.
The loops themselves only say what a batch is and in which order they come.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable, Optional, Sequence

import torch

from ...errors import LeantrainError, NonFiniteError
from ...io.checkpoint import Checkpoint, check_destination, load_checkpoint
from ...io.sharded import check_folder
from ...metrics import BUILTIN as BUILTIN_METRICS
from ...optim import OptState, Optimizer
from ...optim.optimizer import GENERIC, NATIVE
from ..parallel.distributed import ReplicaError
from ..parallel.strategy import choose
from ..runner.loop_state import LoopState
from ..runner.precision import AUTOCAST, LossScaler
from ..runner.runner import Runner, Sample
from ..update.options import StepOptions
from ..update.reduction import Reduction
from ..update.step import update
from .callbacks import Callback
from .checkpoint_folder import CheckpointFolder, resume_path, template_fields
from .config import TrainReport, run_config
from .evaluation import evaluate_sets
from .events import StepCallback, StepEvent
from .listeners import Listeners
from .loop_checks import check_savable, check_schedule, loop_callbacks, restore_callbacks, resume_check, stateful
from .profiling import UpdateProfiler
from .record import RunRecord
from .run_options import deterministic_mode, seed_everything
from .throughput import Throughput

Log = Callable[[str], None]
ScheduleState = Callable[[int, OptState], OptState]


def log_line(step: int, loss: float) -> str:
    return f"step {step}: loss={loss:.6f}"


def uses_native(runner: Runner, opt: Optimizer) -> bool:
    """The loop's path, decided once: native when the optimizer has one and the
    parameters live on device mirrors; never switched mid-run (not even for a short
    last batch), so one history stays on one path."""
    return opt.native and runner.params.has_mirrors()


_NO_RANGE = contextlib.nullcontext()


def _silent(line: str) -> None:
    return None


class Session:
    """The shared state of one run of a loop (``kind``: ``"samples"`` or ``"loader"``).
    ``local``: under ``torch.distributed``, each rank's batches hold its own items
    (``parallel/rank_data.py``)."""

    def __init__(self, op: str, runner: Runner, cfg, kind: str, *, log: Log = print,
                 callback: Optional[StepCallback] = None, callbacks: Sequence[Callback] = (),
                 local: bool = False) -> None:
        self.op, self.runner, self.cfg, self.kind = op, runner, cfg, kind
        scaler = LossScaler(runner.device) if cfg.autocast == "float16" else None
        self.opt: Optimizer = cfg.optimizer
        # How the processes share each update, chosen once for the run (the seam: parallel/).
        self.reduction: Reduction = choose(cfg, local=local)
        self.main = self.reduction.main  # under torch.distributed only rank 0 logs and writes
        self.user_log = log
        # ``print`` and ``None`` (no log lines) are not the user's code: nothing to confirm after them.
        self.log: Log = _silent if log is None or not self.main else log if log is print else self._log
        self.callback = callback
        self.callbacks = loop_callbacks(op, cfg, callbacks, self.main)
        self.listeners = Listeners(op, runner, self.reduction, callback, self.callbacks, callbacks)
        self.record = RunRecord()  # what the run measured and logged, resumed entries first
        self.started = time.perf_counter()
        # The device-side count of skipped steps (skip mode), read once, at the end.
        self.skipped = (torch.zeros((), device=runner.device)
                        if cfg.nonfinite == "skip" or cfg.autocast == "float16" else None)
        self.scaler: Optional[LossScaler] = scaler  # float16's dynamic loss scale
        self.stopped = False
        self.expect: dict = {}  # what a resume must match; saved in every progress
        self.pending: Optional[tuple[dict, OptState, Optional[dict]]] = None  # the newest step
        self.saved = True  # whether ``pending`` is on disk
        self.saved_step: Optional[int] = None  # the step of the newest checkpoint written
        self.saved_path = cfg.checkpoint_path  # and its file
        # A folder of checkpoints ({step} in checkpoint_path): each save a new file, pruned.
        self.folder = CheckpointFolder(op, cfg) if template_fields(cfg.checkpoint_path) else None
        self.resume_from = None
        self.meter = Throughput(runner, cfg.peak_flops)  # rates read at the log cadence only
        self.profiler = UpdateProfiler(op, *cfg.profile, cfg.profile_dir, runner.device) if cfg.profile else None
        self._options: Optional[StepOptions] = None  # how the updates run: built at the first one

    @property
    def logged(self) -> list[tuple[int, float]]:
        """(step, pre-update loss) of the logged updates, resumed ones first."""
        return self.record.logged

    @property
    def last_norm(self) -> Optional[float]:
        """The newest logged update's gradient norm before clipping (``None``: not logged)."""
        return self.record.last_norm

    def event(self, step: int, state: OptState, loss: Optional[float], epoch=None, batch=None) -> StepEvent:
        """What the callbacks hear after update ``step`` (norm and rates on logged updates)."""
        return StepEvent(step, state, loss, epoch, batch, grad_norm=self.record.last_norm,
                         throughput=self.record.last_rates)

    def _log(self, line: str) -> None:
        self.user_log(line)
        self.runner.user_code_ran()  # the user's log function ran: confirm the module at the next step

    @contextlib.contextmanager
    def computing(self):
        """The loop's state installed on the runner while the loop runs: its precision
        (autocast, loss scale) and, with ``compile=True``, its compiled loss."""
        cfg = self.cfg
        state = LoopState(amp=AUTOCAST[cfg.autocast] if cfg.autocast else None,
                          loss_scale=self.scaler.scale if self.scaler is not None else None,
                          compiled=self.runner.compiled_loss() if cfg.compile else None)
        with deterministic_mode(self.op, cfg.deterministic, self.runner.device), self.runner.looping(state):
            try:
                yield
            except BaseException:
                self.reduction.close(self.runner, failed=True)  # the module's memory back (parameter sharding)
                raise

    def options(self, state: OptState) -> StepOptions:
        """The updates' options, built once per loop from the config (on the history's path)."""
        o = self._options
        if o is None or o.native != (state.path == NATIVE):
            o = self._options = StepOptions.of(self.cfg, self.reduction, state.path == NATIVE, self.skipped,
                                               self.scaler)
        return o

    # ------------------------------------------------------------------ start
    def start(self, measure: Callable[[], Optional[float]], expect: dict, loader_check=None
              ) -> tuple[OptState, Optional[Checkpoint]]:
        """A fresh history and the ``before`` loss (``measure()``, with ``measure_loss``), or, with
        ``cfg.resume_from``, the checkpoint's state (its progress must match ``expect``,
        and ``loader_check(manifest, tensors)`` find no problem)."""
        check_schedule(self.op, self.cfg, self.runner)
        check_savable(self.op, self.callbacks)  # before the first update, not at the first save
        if self.folder is not None:
            check_destination(self.op, self.folder.path_for(0, 0, None))
        elif self.cfg.checkpoint_path is not None and self.cfg.sharding is None:
            check_destination(self.op, self.cfg.checkpoint_path)  # a folder is refused now, not at the first save
        elif self.cfg.checkpoint_path is not None:
            check_folder(self.op, self.cfg.checkpoint_path)  # a sharded run saves a folder
        self.expect = dict(expect, ema_decay=self.cfg.ema_decay, autocast=self.cfg.autocast)
        self.reduction.check_shared(self.op, self.cfg.checkpoint_path)  # before any rank looks for a checkpoint
        self.resume_from = resume_path(self.cfg, self.folder)
        if self.resume_from is not None and self.cfg.resume_from == "auto":
            self.log(f"{self.op}: resuming from {self.resume_from}")
        self.reduction.agree_on_start(self.op, dict(self.expect, resume=self.resume_from is not None))
        # Nothing of the runner changes (its mode, its moving average) until the start is accepted.
        if self.resume_from is None:
            if self.cfg.seed is not None:
                seed_everything(self.cfg.seed)  # a fresh run only: a resume restores the saved generators
            self._start_replicas()
            state = self.reduction.start(self.op, self.cfg, self.runner, self.opt, uses_native(self.runner, self.opt))
            self.runner.train()
            if self.cfg.ema_decay is not None:
                self.runner.keep_ema(self.reduction.ema(self.runner, self.cfg.ema_decay))
            with self.reduction.guard(self.op):
                self.record.before = measure() if self.cfg.measure_loss else None
            return state, None
        ck = self._resume(self.expect, loader_check)
        self.runner.train()
        if self.scaler is not None:
            self.scaler.scale.fill_(ck.progress["loss_scale"])
            self.scaler.tracker.fill_(ck.progress["scale_tracker"])
        restore_callbacks(self.op, self.callbacks, ck.progress.get("callbacks", []))
        if self.folder is not None:
            self.folder.resume(ck.progress.get("checkpoints", []))
        self.record = RunRecord.resumed(ck.progress)
        self._start_replicas()
        state = self.reduction.start(self.op, self.cfg, self.runner, self.opt, ck.state.path == NATIVE, ck.state)
        if self.cfg.ema_decay is not None:
            self.runner.keep_ema(self.reduction.ema(self.runner, self.cfg.ema_decay, ck.ema))
        # the loops keep the checkpoint's progress and loader position only: the whole optimizer state
        # and moving average it read are dropped now (a sharded rank keeps its ranges, not +2x the weights)
        return state, dataclasses.replace(ck, state=None, ema=None)

    def _resume(self, expect: dict, loader_check=None) -> Checkpoint:
        """Load the checkpoint; whether it fits this run (its kind, ``expect``, the update
        path, and ``loader_check``) is decided before anything is installed."""
        path = self.resume_from
        want_path = NATIVE if uses_native(self.runner, self.opt) else GENERIC

        extra = [loader_check] if loader_check is not None else []
        if self.folder is not None:
            extra.append(lambda manifest, tensors: self.folder.problems(manifest["progress"].get("checkpoints", [])))
        fits = resume_check(self.kind, self.cfg, expect, want_path, self.scaler is not None, extra)
        return load_checkpoint(path, self.runner, optimizer=self.opt, accept=fits, follow_trainable=True,
                               host_state=self.reduction.host_state)  # sharding moves its ranges only

    # ----------------------------------------------------------------- steps
    def update(self, state: OptState, batch: list[Sample], step: int) -> tuple[OptState, Optional[float]]:
        """One update at index ``step``; the loss is read (one host read) only when a log
        line is due."""
        if self.profiler is not None:
            self.profiler.before(step + 1)
            with self.profiler.range("leantrain.update"):
                return self._update(state, batch, step)
        return self._update(state, batch, step)

    def _update(self, state: OptState, batch: list[Sample], step: int) -> tuple[OptState, Optional[float]]:
        cfg = self.cfg
        want = bool(cfg.log_every) and step % cfg.log_every == 0
        self.runner.confirm_steady()  # the user's code may have run: before anything reads what was checked
        self.reduction.check_step(self.op, self.runner, batch)
        try:
            with self.reduction.guard(self.op):
                done = update(self.op, self.runner, self.opt, state, batch, self.options(state), want)
        except NonFiniteError as e:
            raise NonFiniteError(f"update {step + 1}: {e}") from None  # updates count from 1, as everywhere
        except Exception as e:  # a collective's failure, or the user's own error (with its rank under torchrun)
            self._collective_failed(e, f"update {step + 1}")
        state = done.state
        if cfg.ema_decay is not None:
            self.runner.ema.update(self.runner.params)  # after the step, on the device
        record = self.record
        record.last_norm = record.last_rates = None
        self.meter.count(batch)
        if not want:
            return state, None
        if done.norm is None:
            value = float(done.loss.item())  # intentional sync: a log line is due
        else:  # intentional sync, one read for both: a log line is due
            value, record.last_norm = torch.stack([done.loss.detach().double(), done.norm.double()]).tolist()
            record.grad_norms.append((step, record.last_norm))
        record.logged.append((step, value))
        record.last_rates = self.meter.read()
        self.log(log_line(step, value))
        return state, value

    def _collective_failed(self, e: Exception, where: str) -> None:
        """Re-raise ``e``; under torch.distributed as a ``CollectiveError`` saying where it
        happened and which checkpoint survives (a peer died, stopped or timed out), or, when
        it is the user's own error, as itself with a note naming the rank."""
        last = (f"{self.saved_path} (step {self.saved_step})" if self.saved_step is not None
                else "none saved yet")
        self.reduction.failed(self.op, e, where, last)

    def _start_replicas(self) -> None:
        try:
            self.reduction.start_replicas(self.runner, self.cfg.replica_check)
        except RuntimeError as e:
            if isinstance(e, ReplicaError):  # the replicas differ: that message, as it is
                raise
            self._collective_failed(e, "start")

    def begin(self, total: Optional[int], start: int) -> None:
        """Tell the callbacks the run's length in updates (``None``: unknown) and its start."""
        for cb in self.callbacks:
            cb.on_config(run_config(self.cfg))
            cb.on_begin(total, start)
        self.meter.start()

    def after_update(self, event: StepEvent, progress: dict, loader_state: Optional[dict] = None) -> bool:
        """Hear the callbacks (and evaluate when due); save on the cadence, or when asked
        to stop. True: stop."""
        if self.profiler is not None:
            with self.profiler.range("leantrain.after_update"):
                stop = self._after_update(event, progress, loader_state)
            self.profiler.after(event.step)
            return stop
        return self._after_update(event, progress, loader_state)

    def _after_update(self, event: StepEvent, progress: dict, loader_state: Optional[dict]) -> bool:
        stop = self.listeners.step(event)
        evaluated = self.cfg.eval_due(event.step)
        if evaluated:
            stop = self.evaluate(event.step) or stop
        self.pending, self.saved = (dict(progress, step=event.step), event.state, loader_state), False
        every = self.cfg.checkpoint_every
        best = evaluated and self.cfg.keep_best is not None  # each evaluated update saved, to be ranked
        if self.cfg.checkpoint_path and (stop or best or (every and event.step % every == 0)):
            self.save()
        self.stopped = stop
        return stop

    def end_epoch(self, event: StepEvent, epoch: int) -> bool:
        """After a loader epoch's last update: the callbacks, and an evaluation when one
        is due by epochs (``eval_every_epochs``; not twice after one update). True: stop
        (saved first)."""
        stop = self.listeners.epoch_end(event)
        if self.cfg.epoch_eval_due(epoch) and not (self.record.evals and self.record.evals[-1][0] == event.step):
            stop = self.evaluate(event.step) or stop
            if self.cfg.keep_best is not None:
                self.saved = False  # saved again with its metric, to be ranked
                self.save()
        if stop:
            self.stopped = True
            if self.cfg.checkpoint_path:
                self.save()
        return stop

    def evaluate(self, step: int) -> bool:
        """Evaluate on ``cfg.eval_data``, keep the results, tell the callbacks."""
        with self.profiler.range("leantrain.evaluate") if self.profiler is not None else _NO_RANGE:
            results = evaluate_sets(self.runner, self.cfg.eval_data, self.cfg.eval_metrics, ema=self.cfg.eval_ema)
        self.record.evals.append((step, results))
        metrics = (self.cfg.eval_metrics or {}).values()
        return self.listeners.evaluated(step, results, any(fn not in BUILTIN_METRICS for fn in metrics))

    def save(self) -> None:
        """Write the newest step's checkpoint (rank 0 only)."""
        if self.pending is None:
            return
        if self.runner.params.has_mirrors():
            self.runner.recheck()  # saving syncs mirrors to the host: check again at the next step
        progress, state, loader_state = self.pending
        step, path, kept = progress["step"], self.cfg.checkpoint_path, {}
        if self.folder is not None:
            metric = self.record.metric_at(step, self.cfg.monitor)
            path = self.folder.path_for(step, progress.get("epoch"), metric)
            kept = {"checkpoints": self.folder.record(path, step, metric)}
        # the loader's position (a function: asked for when a file is written)
        with self.profiler.range("leantrain.checkpoint") if self.profiler is not None else _NO_RANGE:
            try:
                self.reduction.save(path, self.runner, state, dict(self._progress(progress), **kept), loader_state,
                                    self.runner.ema if self.cfg.ema_decay is not None else None)
            except LeantrainError:
                raise
            except Exception as e:  # a peer lost inside a sharded save: a CollectiveError naming what survives
                self._collective_failed(e, f"saving the checkpoint of update {step}")
        if self.folder is not None:
            self.folder.written(path, kept["checkpoints"], self.main)
        self.saved, self.saved_step, self.saved_path = True, step, path

    def _progress(self, progress: dict) -> dict:
        """A checkpoint's progress record: the step's, with the run's history."""
        return dict(self.expect, **progress, kind=self.kind, seed=self.cfg.seed, **self.record.progress(),
                    **self._callback_states(), **(self.scaler.state() if self.scaler is not None else {}))

    def _callback_states(self) -> dict:
        states = [[type(cb).__name__, cb.state_dict()] for cb in stateful(self.callbacks)]
        return {"callbacks": states} if states else {}

    # ---------------------------------------------------------------- finish
    def finish(self, measure: Callable[[], Optional[float]], steps: int, seen: int) -> TrainReport:
        """The final checkpoint (unless the newest step is saved), the ``after`` loss
        (``measure()``), the module synced to the trained values, and the report."""
        if self.cfg.checkpoint_path and not self.saved:
            self.save()
        if self.profiler is not None:
            self.profiler.close()  # the run ended inside the profiled updates: write what was recorded
        self.reduction.finish(self.runner)
        best = self.folder.best() if self.folder is not None and self.cfg.keep_best is not None else None
        if best is not None and self.cfg.load_best_at_end:
            load_checkpoint(best, self.runner, restore_rng=False)  # the best parameters, nothing else
        after = measure() if self.cfg.measure_loss else None
        self.runner.sync()  # intentional, once: the module shows the trained values
        skipped = 0 if self.skipped is None else int(self.skipped.item())  # intentional, end of run
        r = self.record
        report = TrainReport(
            r.before, after, steps, seen, tuple(r.logged), time.perf_counter() - self.started,
            interrupted=self.stopped, skipped_steps=skipped, evals=tuple(r.evals), grad_norms=tuple(r.grad_norms),
            best_checkpoint=None if best is None else str(best),
            resumed_from=None if self.resume_from is None else str(self.resume_from),
        )
        for cb in self.callbacks:
            cb.on_end(report)
        return report
