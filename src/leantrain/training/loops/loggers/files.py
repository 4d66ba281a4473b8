"""The run's records in files: ``JSONLLogger`` (one JSON object per line) and ``CSVLogger``
(long format), numbered by the update from 1, trimmed to the checkpoint on resume."""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import IO, Optional

from ....errors import ConfigError
from ..callbacks import Callback
from ..events import StepEvent


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
        self._check_path()
        if start and self.path.exists():
            self._trim(start)

    def _check_path(self) -> None:
        """The file can be written: refused when the loop starts, not at the first record."""
        who = f"{type(self).__name__}: {self.path}"
        if self.path.is_dir():
            raise ConfigError(f"{who}: is a folder; give the file to write")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"{who}: its folder cannot be made ({e.strerror or type(e).__name__})") from None
        if not os.access(self.path.parent, os.W_OK) or (self.path.exists() and not os.access(self.path, os.W_OK)):
            raise ConfigError(f"{who}: cannot be written (permission denied)")

    def _open(self) -> IO[str]:
        if self.file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fresh = not self.start or not self.path.exists() or self.path.stat().st_size == 0
            self.file = self.path.open("a" if self.start else "w")
            if fresh:
                self._write(dict(META))
        return self.file

    def _trim(self, start: int) -> None:
        from ....io.atomic import atomic_write_bytes

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
            self.file = self.path.open("a" if self.start else "w", newline="")  # csv writes its own line ends
            self.writer = csv.writer(self.file)
            if fresh:
                self.writer.writerow(["kind", "step", "epoch", "name", "value"])
                self._write(dict(META))
        return self.file

    def _trim(self, start: int) -> None:
        """Keep the records written up to update ``start``, read as CSV records (a quoted
        name may hold a newline or a quote), the one torn by an interruption dropped."""
        from ....io.atomic import atomic_write_bytes

        with self.path.open(newline="") as f:  # csv's own line ends, as written
            text = f.read()
        rows = list(csv.reader(io.StringIO(text, newline="")))
        if rows and not text.endswith(("\n", "\r")):
            rows.pop()  # the record the interruption tore
        header, rows = rows[:1], rows[1:]
        offset = 0 if rows and self._record(rows[0]) == ("meta", 0) else 1
        out = io.StringIO(newline="")
        csv.writer(out).writerows(header + [row for row in rows if _before(self._record(row), start, offset)])
        atomic_write_bytes(self.path, out.getvalue().encode(), type(self).__name__)

    @staticmethod
    def _record(row: list) -> Optional[tuple[str, int]]:
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
