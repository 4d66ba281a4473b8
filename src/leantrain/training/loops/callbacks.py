"""Callbacks: what a loop tells its observers, and the ready ones.

A callback subclasses ``Callback`` and overrides the hooks it needs; a hook that
returns ``True`` asks the loop to stop after the current step (a checkpoint is saved
when one is configured). The loop calls, in order:

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

import csv
import json
import math
import sys
from pathlib import Path
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
    """Stop when ``monitor`` (a key of the evaluation results) has not improved by more
    than ``min_delta`` for ``patience`` evaluations in a row (``mode``: "min" or "max")."""

    reads_only = True

    def __init__(self, monitor: str = "loss", patience: int = 3, mode: str = "min", min_delta: float = 0.0) -> None:
        op = "EarlyStopping"
        check_count(op, "patience", patience, 1)
        check_choice(op, "mode", mode, ("min", "max"))
        if not isinstance(monitor, str):
            raise ConfigError(f"{op}: monitor must be a result name, got {monitor!r}")
        self.monitor, self.patience, self.mode, self.min_delta = monitor, patience, mode, float(min_delta)
        self.best: Optional[float] = None
        self.bad = 0
        self.stopped_step: Optional[int] = None

    def state_dict(self) -> dict:
        return {"best": self.best, "bad": self.bad, "stopped_step": self.stopped_step}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.bad, self.stopped_step = state["best"], state["bad"], state["stopped_step"]

    def on_eval(self, step: int, results: dict) -> bool:
        if self.monitor not in results:
            raise ConfigError(f"EarlyStopping: no result named {self.monitor!r}; the evaluation gives {sorted(results)}")
        value = results[self.monitor]
        sign = 1.0 if self.mode == "min" else -1.0
        if self.best is None or sign * (self.best - value) > self.min_delta:
            self.best, self.bad = value, 0
            return False
        self.bad += 1
        if self.bad >= self.patience:
            self.stopped_step = step
            return True
        return False


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


class JSONLLogger(Callback):
    """One JSON object per line. ``step`` counts updates from 1 in every record: ``{"kind":
    "step", "step", "epoch", "loss", "lr"}`` on logged updates (``loss``: measured before
    that update; ``grad_norm`` when clipping by norm), ``{"kind": "eval", "step",
    ...results}`` after each evaluation (the updates done), and ``{"kind": "epoch",
    "step", "epoch"}`` after a loader epoch's last update, with the results of the
    evaluation made at that epoch's end, their names prefixed by ``epoch_results``
    (``eval_loss``...; ``"test_"`` gives ``test_loss``). A fresh file starts with
    ``{"kind": "meta", "format": 2, "step": 0}``; files without it (written before
    leantrain counted step records from 1) number step records from 0, and
    ``step_offset`` reads both.

    The file is opened at the first record, so an earlier file survives until the run has
    something to write (a finished run with no record still leaves an empty file)."""

    reads_only = True

    def __init__(self, path, epoch_results: str = "eval_") -> None:
        self.path = Path(path)
        self.prefix = epoch_results
        self.file: Optional[IO[str]] = None
        self.start = 0
        self.epoch: Optional[dict] = None  # the newest epoch's record, until its evaluation is in

    def on_begin(self, total: Optional[int], start: int) -> None:
        """A fresh run starts the file; a resumed one keeps what was written up to its
        checkpoint and drops the rest (written after it, before the interruption), so
        the file holds each record once."""
        self.start = start
        if start and self.path.exists():
            self._trim(start)

    def _open(self) -> IO[str]:
        if self.file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fresh = not self.start or not self.path.exists() or self.path.stat().st_size == 0
            self.file = self.path.open("a" if self.start else "w")
            if fresh:
                self._write(dict(META))
        return self.file

    def _trim(self, start: int) -> None:
        from ...io.atomic import atomic_write_bytes

        lines = self.path.read_text().splitlines(keepends=True)
        offset = 0 if any(self._record(line) == ("meta", 0) for line in lines[:1]) else 1
        kept = [line for line in lines if line.endswith("\n") and _before(self._record(line), start, offset)]
        atomic_write_bytes(self.path, "".join(kept).encode(), type(self).__name__)

    @staticmethod
    def _record(line: str) -> Optional[tuple[str, int]]:
        try:
            r = json.loads(line)
            return r["kind"], int(r["step"])
        except (ValueError, KeyError, TypeError):
            return None

    def _write(self, record: dict) -> None:
        self._open().write(json.dumps(record) + "\n")
        self.file.flush()

    def _flush_epoch(self) -> None:
        if self.epoch is not None:
            record, self.epoch = self.epoch, None
            self._write(record)

    def on_step(self, event: StepEvent) -> None:
        self._flush_epoch()
        if event.loss is not None:
            record = {"kind": "step", "step": event.step, "epoch": event.epoch,
                      "loss": event.loss, "lr": event.state.lr}
            if event.grad_norm is not None:
                record["grad_norm"] = event.grad_norm  # before clipping
            record.update(event.throughput or {})
            self._write(record)

    def on_epoch_end(self, event: StepEvent) -> None:
        self._flush_epoch()
        self.epoch = {"kind": "epoch", "step": event.step, "epoch": event.epoch}

    def on_eval(self, step: int, results: dict) -> None:
        self._write({"kind": "eval", "step": step, **results})
        if self.epoch is not None and self.epoch["step"] == step:
            self.epoch.update({self.prefix + k: v for k, v in results.items() if k != "items"})
            self._flush_epoch()

    def on_end(self, report) -> None:
        self._flush_epoch()
        if self.file is None and not self.start:
            self._open()  # a finished run with no record still has its file
        if self.file is not None:
            self.file.close()
            self.file = None


class CSVLogger(JSONLLogger):
    """The same records as ``JSONLLogger``, long format: ``kind,step,epoch,name,value``."""

    writer = None

    def _open(self) -> IO[str]:
        if self.file is None:
            fresh = not self.start or not self.path.exists() or self.path.stat().st_size == 0
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = self.path.open("a" if self.start else "w")
            self.writer = csv.writer(self.file)
            if fresh:
                self.writer.writerow(["kind", "step", "epoch", "name", "value"])
                self._write(dict(META))
        return self.file

    def _trim(self, start: int) -> None:
        lines = self.path.read_text().splitlines(keepends=True)
        offset = 0 if any(self._record(line) == ("meta", 0) for line in lines[1:2]) else 1
        kept = lines[:1] + [line for line in lines[1:]
                            if line.endswith("\n") and _before(self._record(line), start, offset)]
        self.path.write_text("".join(kept))

    @staticmethod
    def _record(line: str) -> Optional[tuple[str, int]]:
        row = next(csv.reader([line]), [])
        try:
            return row[0], int(row[1])
        except (IndexError, ValueError):
            return None

    def _write(self, record: dict) -> None:
        self._open()
        record = dict(record)
        kind, step, epoch = record.pop("kind"), record.pop("step"), record.pop("epoch", None)
        for name, value in record.items():
            self.writer.writerow([kind, step, "" if epoch is None else epoch, name, value])
        self.file.flush()


class TensorBoardLogger(Callback):
    """Scalars for TensorBoard: ``train/loss`` and ``train/lr`` on logged steps,
    ``eval/NAME`` after evaluations. Needs ``pip install leantrain[tensorboard]``."""

    reads_only = True

    def __init__(self, log_dir) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "TensorBoardLogger: the tensorboard package is not installed; "
                "install it with: pip install 'leantrain[tensorboard]'"
            ) from None
        self.log_dir, self.writer = str(log_dir), SummaryWriter(str(log_dir))

    def on_begin(self, total: Optional[int], start: int) -> None:
        if start:  # a resumed run: TensorBoard drops what was written after the checkpoint
            from torch.utils.tensorboard import SummaryWriter

            self.writer.close()
            self.writer = SummaryWriter(self.log_dir, purge_step=start)

    def on_step(self, event: StepEvent) -> None:
        if event.loss is not None:
            self.writer.add_scalar("train/loss", event.loss, event.step - 1)
            self.writer.add_scalar("train/lr", event.state.lr, event.step - 1)
            if event.grad_norm is not None:
                self.writer.add_scalar("train/grad_norm", event.grad_norm, event.step - 1)
            for name, value in (event.throughput or {}).items():
                self.writer.add_scalar(f"train/{name}", value, event.step - 1)

    def on_eval(self, step: int, results: dict) -> None:
        for name, value in results.items():
            if name != "items" and math.isfinite(value):
                self.writer.add_scalar(f"eval/{name}", value, step)

    def on_end(self, report) -> None:
        self.writer.close()


def _before(record: Optional[tuple[str, int]], start: int, offset: int = 0) -> bool:
    """Whether a logged record was written before a checkpoint at update ``start``: every
    record names the updates done (``offset`` 1: a step record of an older file names its
    update's 0-based index)."""
    if record is None:
        return False  # a line torn by the interruption
    kind, step = record
    return step + (offset if kind == "step" else 0) <= start


META = {"kind": "meta", "format": 2, "step": 0}  # the first record: step records count updates from 1


def step_offset(records: list) -> int:
    """What to add to a step record's ``step`` to count updates from 1: 0 for a file
    that starts with ``META``, 1 for one written before (0-based step records)."""
    first = records[0] if records else None
    return 0 if isinstance(first, dict) and first.get("kind") == "meta" and first.get("format") == 2 else 1
