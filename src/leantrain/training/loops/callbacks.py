"""Callbacks: what a loop tells its observers, and the ready ones.

A callback subclasses ``Callback`` and overrides the hooks it needs; a hook that
returns ``True`` asks the loop to stop after the current step (a checkpoint is saved
when one is configured). The loop calls, in order:

* ``check_names(op, results)``: the names the evaluations will give, once, before
  anything runs (refuse one it cannot record);
* ``on_config(config)``: the loop's settings as plain data, once;
* ``on_begin(total, start)``: the number of updates the run will have made when it
  ends (``None`` when a loader's length is unknown) and the update it starts from;
* ``on_step(event)`` after each update (``event.loss`` is set on logged steps only, so
  logging never adds a host read);
* ``on_epoch_end(event)`` after a loader epoch's last update;
* ``on_eval(step, results)`` after each evaluation (``evaluate``'s dict);
* ``on_end(report)`` once, with the ``TrainReport``.
"""

from __future__ import annotations

import math
import sys
from typing import IO, Callable, Optional

from ...errors import ConfigError
from ...validate import check_choice, check_count
from .events import StepEvent


class Callback:
    """Base class of loop callbacks: every hook does nothing.

    ``reads_only``: set it to True on a callback whose hooks only read (the event, the
    results, the report) and never change the module, its parameters or the runner; a
    loop then need not check the module again after it runs (see ``Runner.steady``).
    The default, False, is always safe.

    ``every_rank``: under ``torch.distributed`` callbacks run on rank 0 only, except
    those that set this to True (one that agrees with the other ranks on stopping, with a
    collective, must run on all of them and answer alike)."""

    reads_only = False
    every_rank = False

    def on_config(self, config: dict) -> None:
        """Before ``on_begin``, once: the loop's settings as plain data (``run_config``)."""
        return None

    def check_names(self, op: str, results: set) -> None:
        """When the loop starts, before anything runs: the names its evaluations will give
        (``results``, empty without ``eval_data``). Raise ``ConfigError`` to refuse a name
        this callback could not record (a tracker's rules), rather than fail at the first
        evaluation."""
        return None

    def on_begin(self, total: Optional[int], start: int) -> None:
        """Before the first update: ``total`` updates the run will have made when it ends (``None`` when a
        loader's length is unknown) and ``start``, the update it starts from (0, or a resume's step).
        """
        return None

    def state_dict(self) -> Optional[dict]:
        """What the callback must carry across a resume (JSON data), saved in every
        checkpoint; ``None`` (the default): nothing."""
        return None

    def load_state_dict(self, state: dict) -> None:
        """Take back what ``state_dict`` gave, when a run resumes (before ``on_begin``)."""
        return None

    def on_step(self, event: StepEvent) -> Optional[bool]:
        """After each update. ``event.loss`` is set on logged steps only (logging never adds a host
        read). Return ``True`` to stop the run after this step (a checkpoint is saved when configured).
        """
        return None

    def on_epoch_end(self, event: StepEvent) -> Optional[bool]:
        """After a loader epoch's last update; return ``True`` to stop."""
        return None

    def on_eval(self, step: int, results: dict) -> Optional[bool]:
        """After each evaluation, with ``evaluate``'s results; return ``True`` to stop."""
        return None

    def on_end(self, report) -> None:
        """Once, when the loop returns, with the ``TrainReport``."""
        return None


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved by more than ``min_delta`` for ``patience``
    checks in a row (``mode``: "min" or "max"; ``patience=0``: the first check without
    improvement stops), as Lightning's ``EarlyStopping``. ``monitor``: a key of the
    evaluation results, or ``"train_loss"``: the training loss of each logged update (no
    evaluation needed; ``log_every`` sets how often it is checked). At each check, in
    Lightning's order: a value that is not finite stops the run (``check_finite``); one
    that reaches ``stopping_threshold`` stops it (good enough); one worse than
    ``divergence_threshold`` stops it (diverging); else the patience rule. Under
    ``torch.distributed`` the decision is the job's (every rank stops at that update)."""

    reads_only = True
    TRAIN = "train_loss"

    def __init__(self, monitor: str = "loss", patience: int = 3, mode: str = "min", min_delta: float = 0.0,
                 stopping_threshold: Optional[float] = None, divergence_threshold: Optional[float] = None,
                 check_finite: bool = True) -> None:
        op = "EarlyStopping"
        check_count(op, "patience", patience, 0)
        check_choice(op, "mode", mode, ("min", "max"))
        if not isinstance(monitor, str):
            raise ConfigError(f"{op}: monitor must be a result name, got {monitor!r}")
        if not isinstance(check_finite, bool):
            raise ConfigError(f"{op}: check_finite must be True or False, got {check_finite!r}")
        for name, value in (("min_delta", min_delta), ("stopping_threshold", stopping_threshold),
                            ("divergence_threshold", divergence_threshold)):
            if (value is not None or name == "min_delta") and not (
                    isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)):
                raise ConfigError(f"{op}: {name} must be a finite number{'' if name == 'min_delta' else ' or None'}, "
                                  f"got {value!r}")
        self.monitor, self.patience, self.mode, self.min_delta = monitor, patience, mode, float(min_delta)
        self.stopping_threshold, self.divergence_threshold = stopping_threshold, divergence_threshold
        self.check_finite = check_finite
        self.best: Optional[float] = None
        self.bad = 0
        self.stopped_step: Optional[int] = None
        self.reason: Optional[str] = None  # why it stopped the run

    def state_dict(self) -> dict:
        return {"best": self.best, "bad": self.bad, "stopped_step": self.stopped_step}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.bad, self.stopped_step = state["best"], state["bad"], state["stopped_step"]

    def on_step(self, event: StepEvent) -> bool:
        if self.monitor != self.TRAIN or event.loss is None:
            return False
        return self._check(event.step, event.loss)

    def on_eval(self, step: int, results: dict) -> bool:
        if self.monitor == self.TRAIN:
            return False
        if self.monitor not in results:
            raise ConfigError(f"EarlyStopping: no result named {self.monitor!r}; the evaluation gives {sorted(results)}")
        return self._check(step, results[self.monitor])

    def _check(self, step: int, value: float) -> bool:
        value = float(value)
        sign = 1.0 if self.mode == "min" else -1.0
        if self.check_finite and not math.isfinite(value):
            return self._stop(step, f"{self.monitor} = {value} is not finite")
        if self.stopping_threshold is not None and sign * (value - self.stopping_threshold) < 0:
            return self._stop(step, f"{self.monitor} = {value} reached stopping_threshold={self.stopping_threshold}")
        if self.divergence_threshold is not None and sign * (value - self.divergence_threshold) > 0:
            return self._stop(step, f"{self.monitor} = {value} diverged past divergence_threshold="
                                    f"{self.divergence_threshold}")
        if self.best is None or sign * (self.best - value) > self.min_delta:
            self.best, self.bad = value, 0
            return False
        self.bad += 1
        if self.bad >= max(self.patience, 1):  # patience=0: the first check without improvement
            return self._stop(step, f"{self.monitor} did not improve for {self.bad} check(s)")
        return False

    def _stop(self, step: int, reason: str) -> bool:
        self.stopped_step, self.reason = step, reason
        return True


class PlateauFeed(Callback):
    """What a loop adds for a ``Plateau`` schedule: each evaluation's monitored value fed to
    it, its counters kept in every checkpoint (on every rank: the rate must agree)."""

    every_rank = True

    def __init__(self, schedule) -> None:
        self.schedule, self.loaded = schedule, False

    def state_dict(self) -> dict:
        return self.schedule.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.schedule.load_state_dict(state)
        self.loaded = True

    def on_begin(self, total: Optional[int], start: int) -> None:
        if not self.loaded:  # a fresh run starts at the base rate, whatever an earlier run left
            self.schedule.reset()

    def on_eval(self, step: int, results: dict) -> None:
        self.schedule.observe(results[self.schedule.monitor])


class ProgressBar(Callback):
    """A tqdm bar over the run's updates, with the last logged loss and the rate, and a
    line per evaluation (``eval_line(step, results)`` formats it; by default
    ``step N: eval loss=...``). The loops add one when they run in a terminal with
    logging on (``log_every > 0``). ``disable``: tqdm's (``None``: no bar unless the
    output is a terminal; the evaluation lines are printed either way)."""

    reads_only = True

    def __init__(self, file: Optional[IO[str]] = None, eval_line: Optional[Callable[[int, dict], str]] = None,
                 disable: Optional[bool] = False) -> None:
        self.file, self.eval_line, self.disable = file, eval_line, disable
        self.bar = None

    def on_begin(self, total: Optional[int], start: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=start, unit="step", file=self.file or sys.stderr,
                        dynamic_ncols=self.file is None, leave=False, disable=self.disable)

    def on_step(self, event: StepEvent) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if event.loss is not None:
                rates = event.throughput or {}
                shown = {"tok/s": f"{rates['tokens_per_s']:.3g}"} if "tokens_per_s" in rates else {}
                self.bar.set_postfix(loss=f"{event.loss:.4f}", lr=f"{event.state.lr:.3g}", **shown)

    def on_eval(self, step: int, results: dict) -> None:
        if self.bar is None:
            return
        if self.eval_line is not None:
            line = self.eval_line(step, results)
        else:
            line = f"step {step}: eval " + ", ".join(f"{k}={v:.4g}" for k, v in results.items() if k != "items")
        self.bar.write(line, file=self.file)

    def on_end(self, report) -> None:
        if self.bar is not None:
            self.bar.close()
