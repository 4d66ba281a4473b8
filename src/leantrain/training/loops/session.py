"""One training run: what the fixed-step and loader loops share.

A ``Session`` starts the run (a fresh optimizer history and the ``before`` loss, or the
state and progress of the checkpoint it resumes from), performs each update, and after
each one logs (the loss read back only when a log line is due), hears the callbacks,
evaluates when due and hands the checkpoints their turn; it finishes with the ``after``
loss and the ``TrainReport``. The loops only say what a batch is and in which order
they come. Its components each own their concern and state, as torchtitan's trainer
holds its checkpointer: the ``Strategy`` (how processes share the run, chosen once:
``parallel/choose.py``), the ``Checkpointer`` (``checkpointing.py``), the
``Listeners`` (the user's code between updates), the ``Evaluator`` (``evaluator.py``:
evaluation's settings, cadence and results), the run's ``RunRecord``. Each is handed its
own settings record (``cfg.checkpoints``, ``cfg.evaluation``, ``cfg.parallel``), not the
config. Updates are numbered from 1 everywhere (``events.py``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Optional, Sequence

import torch

from ...errors import NonFiniteError
from ...io.loading import Checkpoint
from ...optim import OptState, Optimizer
from ...optim.optimizer import NATIVE
from ..parallel.choose import choose
from ..parallel.strategy import Strategy
from ..runner.loop_state import LoopState
from ..runner.precision import AUTOCAST, LossScaler
from ..runner.runner import Runner, Sample
from ..update.options import StepOptions
from ..update.step import Update, update
from .callbacks import Callback
from .checkpointing import Checkpointer, resumed, uses_native
from .config import TrainReport, run_config
from .evaluator import Evaluator
from .events import Progress, StepCallback, StepEvent
from .listeners import Listeners
from .loop_checks import check_start, loop_callbacks, run_optimizer
from .profiling import UpdateProfiler
from .record import RunRecord
from .run_options import loop_context, seed_everything
from .throughput import Throughput

Log = Callable[[str], None]
ScheduleState = Callable[[int, OptState], OptState]


def log_line(step: int, loss: float) -> str:
    """The console's line for update ``step`` (counted from 1)."""
    return f"step {step}: loss={loss:.6f}"


_NO_RANGE = contextlib.nullcontext()
_silent: Callable[[str], None] = lambda line: None  # noqa: E731 (no log lines)


class Session:
    """The shared state of one run of a loop (``kind``: ``"samples"`` or ``"loader"``).
    ``local``: under ``torch.distributed``, each rank's batches hold its own items
    (``parallel/rank_data.py``)."""

    def __init__(self, op: str, runner: Runner, cfg, kind: str, *, log: Log = print,
                 callback: Optional[StepCallback] = None, callbacks: Sequence[Callback] = (),
                 local: bool = False) -> None:
        self.op, self.runner, self.cfg, self.kind = op, runner, cfg, kind
        self.opt: Optimizer = run_optimizer(op, cfg)  # cfg.optimizer (an SGD under a momentum cycle: a buffer)
        # How the processes share the run, chosen once (the seam: parallel/); its reduction shares each update.
        self.strategy: Strategy = choose(cfg.parallel, local=local)
        self.reduction = self.strategy.reduction
        self.main = self.strategy.main  # under torch.distributed only rank 0 logs and writes
        self.user_log = log
        # ``print`` and ``None`` (no log lines) are not the user's code: nothing to confirm after them.
        self.log: Log = _silent if log is None or not self.main else log if log is print else self._log
        whole = loop_callbacks(op, cfg, callbacks, self.main)  # alike on every rank: their states resume on each
        self.listeners = Listeners(op, runner, self.strategy, callback, whole, callbacks, self._collective_failed)
        self.callbacks = self.listeners.callbacks  # this rank's
        self.record = RunRecord()  # what the run measured and logged, resumed entries first
        # float16's dynamic loss scale
        self.scaler: Optional[LossScaler] = LossScaler(runner.device) if cfg.autocast == "float16" else None
        self.checkpoints = Checkpointer(op, cfg.checkpoints, self.strategy, kind, self.record, whole, self.scaler,
                                        self.log, run=dict(ema_decay=cfg.ema_decay, autocast=cfg.autocast, seed=cfg.seed),
                                        averaging=cfg.averaging, sharded=self.strategy.saves_folder,
                                        span=self._range)
        self.evaluator = Evaluator(cfg.evaluation, kind, runner, self.strategy, self.listeners, self.record, self._range,
                                   self._collective_failed)
        self.started = time.perf_counter()
        # The device-side count of skipped steps (skip mode), read once, at the end.
        self.skipped = (torch.zeros((), device=runner.device)
                        if cfg.nonfinite == "skip" or cfg.autocast == "float16" else None)
        self.stopped, self.total = False, None  # total: the run's updates (begin)
        self.last: Optional[StepEvent] = None  # the newest update's event (an epoch's end hears it)
        self.epoch_ended: Optional[tuple[int, int]] = None  # (epoch, update) whose end a resumed checkpoint saw
        self.resumed_from: Optional[str] = None  # the checkpoint the run continues
        self.meter = Throughput(runner, cfg.peak_flops, cfg.log_memory)  # rates read at the log cadence only
        self.record.count_tokens = lambda: self.strategy.total(self.meter.tokens_seen())
        self.profiler = UpdateProfiler(op, *cfg.profile, cfg.profile_dir, runner.device) if cfg.profile else None
        self._options: Optional[StepOptions] = None  # how the updates run: built at the first one

    def _log(self, line: str) -> None:
        self.user_log(line)
        self.runner.user_code_ran()  # the user's log function ran: confirm the module after the update

    @contextlib.contextmanager
    def computing(self):
        """The loop's state on the runner while it runs (precision, compiled loss, NEFTune)."""
        cfg = self.cfg
        state = LoopState(amp=AUTOCAST[cfg.autocast] if cfg.autocast else None,
                          loss_scale=self.scaler.scale if self.scaler is not None else None,
                          compiled=self.runner.compiled_loss() if cfg.compile else None)
        with loop_context(self.op, cfg, self.runner), self.runner.looping(state):
            try:
                yield
            except BaseException:
                self.strategy.close(self.runner, failed=True)  # the module's memory back (parameter sharding)
                self.checkpoints.close()
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
        ``resume_from``, the checkpoint's state (its progress must match ``expect``,
        and ``loader_check(manifest, tensors)`` find no problem)."""
        cfg, runner, strategy = self.cfg, self.runner, self.strategy
        check_start(self.op, cfg, runner, type(strategy) is Strategy)
        # Nothing of the runner changes (its mode, its moving average) until the start is accepted by every rank.
        saved = self.checkpoints.start(runner, self.opt, expect, {"decides": self.listeners.decides}, loader_check)
        if saved is None:
            if cfg.seed is not None:
                seed_everything(cfg.seed)  # a fresh run only: a resume restores the saved generators
            strategy.start_replicas(self.op, runner)
            state = strategy.start(self.op, runner, self.opt, uses_native(runner, self.opt))
            runner.train()
            if cfg.ema_decay is not None:
                runner.keep_ema(strategy.ema(runner, cfg.ema_decay))
            try:  # a rank's own error named with its rank, a peer's failure a CollectiveError, as in an update
                with strategy.guard(self.op):
                    self.record.before = measure() if cfg.measure_loss else None
            except Exception as e:
                self._collective_failed(e, "the measuring pass before update 1")
            return state, None
        runner.train()
        self.resumed_from = str(saved.path)
        if saved.progress.get("epoch_end"):
            self.epoch_ended = (saved.progress["epoch"], saved.progress["step"])
        strategy.start_replicas(self.op, runner)
        state = strategy.start(self.op, runner, self.opt, saved.state.path == NATIVE, saved.state)
        if cfg.ema_decay is not None:
            runner.keep_ema(strategy.ema(runner, cfg.ema_decay, saved.ema))
        return state, resumed(saved)

    def begin(self, total: Optional[int], start: int) -> None:
        """Tell the callbacks the run's length in updates (``None``: unknown) and its start."""
        self.total = total
        for cb in self.callbacks:
            cb.on_config(run_config(self.cfg))
            cb.on_begin(total, start)
        self.meter.start()

    # ---------------------------------------------------------------- updates
    def logs(self, step: int) -> bool:
        """Whether update ``step`` (from 1) has a log line: the first, then every ``log_every``."""
        every = self.cfg.log_every
        return bool(every) and (step - 1) % every == 0

    def update(self, state: OptState, batch: list[Sample], step: int) -> Update:
        """Update number ``step`` (from 1): the mean, the optimizer, the moving average.
        Its loss stays on the device (``after_update`` reads it when a log line is due)."""
        strategy, watched = self.strategy, self.strategy.watches_updates
        if self.profiler is not None:
            self.profiler.before(step)
        with self._range("leantrain.update"):
            try:
                if watched:
                    strategy.before_update(self.op, self.runner, batch)  # the ranks' batch agreement: a collective
                with strategy.guard(self.op) if watched else _NO_RANGE:
                    # the loss always: the run's mean (TrainReport.train_loss; under torch.distributed one small
                    # all-reduce beside the gradients')
                    done = update(self.op, self.runner, self.opt, state, batch, self.options(state), True)
            except NonFiniteError as e:
                raise NonFiniteError(f"update {step}: {e}") from None
            except Exception as e:  # a collective's failure, or the user's own error (with its rank under torchrun)
                self._collective_failed(e, f"update {step}")
        if self.cfg.ema_decay is not None:
            self.runner.ema.update(self.runner.params)  # after the step, on the device
        self.record.train_loss.add(done.loss, step)  # on the device, never read here
        return done

    def _range(self, name: str):
        return self.profiler.range(name) if self.profiler is not None else _NO_RANGE

    def _collective_failed(self, e: Exception, where: str) -> None:
        """Re-raise ``e``; under torch.distributed as a ``CollectiveError`` saying where it
        happened and which checkpoint survives (a peer died, stopped or timed out), or, when
        it is the user's own error, as itself with a note naming the rank."""
        self.strategy.failed(self.op, e, where, self.checkpoints.last())

    def after_update(self, done: Update, batch: list, at: Progress, loader_state=None) -> bool:
        """After update ``at.step``: its log line when due, the callbacks, an evaluation
        when due, the checkpoint's turn. True: stop. ``loader_state``: the loader's
        position (a function, asked only when a file is written)."""
        step, record, ck = at.step, self.record, self.checkpoints
        if self.cfg.averaging is not None:  # before the callbacks, the evaluation and the checkpoint see it
            self.cfg.averaging.after_update(self.runner, at, self.cfg)
        with self._range("leantrain.after_update"):
            record.last_norm = record.last_rates = None
            self.meter.count(batch)
            loss = self._logged(done, step) if self.logs(step) else None
            event = self.last = StepEvent(step, done.state, loss, at.epoch, at.batch, grad_norm=record.last_norm,
                                          throughput=record.last_rates)
            stop = self.listeners.step(event)
            evaluated = self.evaluator.due(step, self.total)
            if evaluated:
                stop = self.evaluator.run(step) or stop
            hooks = ("on_step", "on_eval") if evaluated else ("on_step",)
            decide = (lambda s: self.listeners.decide(s, step, hooks)) if self.listeners.decides else None
            stop = ck.turn(self.runner, dict(at.record(), step=step), done.state, loader_state, stop=stop,
                           evaluated=evaluated, decide=decide)
            self.stopped = stop
            self.runner.confirm_steady()  # after the user's code: the checks still hold, or are made again
        if self.profiler is not None:
            self.profiler.after(step)
        return stop

    def _logged(self, done: Update, step: int) -> float:
        """Read update ``step``'s loss (and norm) back, keep it, print its log line."""
        record = self.record
        if done.norm is None:
            value = float(done.loss.item())  # intentional sync: a log line is due
        else:  # intentional sync, one read for both: a log line is due
            value, record.last_norm = torch.stack([done.loss.detach().double(), done.norm.double()]).tolist()
            record.grad_norms.append((step, record.last_norm))
        record.logged.append((step, value))
        record.last_rates = self.meter.read()
        self.log(log_line(step, value))
        return value

    def end_epoch(self, at: Progress, state: OptState, loader_state=None) -> bool:
        """After a loader epoch's last update (``at``): the callbacks, and an evaluation
        when one is due by epochs (``eval_every_epochs``; not twice after one update).
        True: stop (saved first). Also where a resumed run starts at an epoch's last batch:
        the interrupted run's checkpoint was written before this end, which runs now
        (unless the checkpoint says it had run)."""
        if self.last is None and (at.epoch, at.step) == self.epoch_ended:
            return False  # resumed from a checkpoint written after this epoch's end
        event = self.last
        if event is None or event.step != at.step:
            event = self.last = StepEvent(at.step, state, None, at.epoch, at.batch)
        stop = self.listeners.epoch_end(event)
        evaluated = self.evaluator.epoch_due(at.epoch, at.step)
        if evaluated:
            stop = self.evaluator.run(at.step) or stop
        hooks = ("on_epoch_end", "on_eval") if evaluated else ("on_epoch_end",)
        # saved with its metric, to be ranked; or because the job stops
        stop = self.checkpoints.turn(self.runner, dict(at.record(), step=at.step), state, loader_state, stop=stop,
                                     evaluated=evaluated, epoch_end=True,
                                     decide=lambda s: self.listeners.decide(s, at.step, hooks))
        self.stopped = self.stopped or stop
        self.runner.confirm_steady()
        return stop

    # ---------------------------------------------------------------- finish
    def finish(self, measure: Callable[[], Optional[float]], steps: int, seen: int) -> TrainReport:
        """The final checkpoint, the ``after`` loss (``measure()``), the module's values, the report."""
        self.checkpoints.finish(self.runner)
        if self.profiler is not None:
            self.profiler.close()  # the run ended inside the profiled updates: write what was recorded
        early = self.cfg.measure_loss and not self.strategy.ends_whole  # the module ends released: measure first
        after = measure() if early else None
        self.strategy.finish(self.runner)
        best = self.checkpoints.load_best(self.runner)
        after = measure() if self.cfg.measure_loss and not early else after
        self.runner.sync()  # intentional, once: the module shows the trained values
        skipped = 0 if self.skipped is None else int(self.skipped.item())  # intentional, end of run
        r, resumed_from = self.record, self.resumed_from
        report = TrainReport(
            r.before, after, steps, seen, tuple(r.logged), time.perf_counter() - self.started,
            interrupted=self.stopped, skipped_steps=skipped, evals=tuple(r.evals), grad_norms=tuple(r.grad_norms),
            best_checkpoint=None if best is None else str(best),
            resumed_from=resumed_from, tokens_seen=r.tokens_seen(), train_loss=r.train_loss.mean(),
        )
        for cb in self.callbacks:
            cb.on_end(report)
        self.checkpoints.close()
        return report
