"""Loggers: the run's records written where a user reads them, one callback each.

* ``JSONLLogger`` and ``CSVLogger``: files, one record per logged update, evaluation
  and epoch (the CSV in long format);
* ``TensorBoardLogger``: scalars under ``train/`` and ``eval/``;
* ``WandbLogger`` and ``MLflowLogger``: experiment trackers.

Every logger numbers records by the update (counted from 1, as the console and the
report do); a step record holds the loss measured before that update. All only read
(``reads_only``); under ``torch.distributed`` they run on rank 0.

The trackers log the loop's settings once (``on_config``), then per logged update
``train/loss``, ``train/lr``, ``train/grad_norm`` (clipping by norm) and the throughput
(``train/samples_per_s``, ``train/tokens_per_s``, ``train/mfu``), and after each
evaluation ``eval/NAME`` for every result. A tracker keeps its run's id in every
checkpoint, so a resumed run continues the same tracker run; the updates between the
checkpoint and the interruption are logged again by the resumed run (the tracker keeps
both values for those steps; W&B's server can rewind a run, offline runs cannot).
``pip install 'leantrain[tensorboard]'``, ``'leantrain[wandb]'`` or
``'leantrain[mlflow]'``; without the package the constructor raises ``ConfigError``.
"""

from __future__ import annotations

import csv
import json
import math
import time
import uuid
from pathlib import Path
from typing import IO, Any, Optional

from ...errors import ConfigError
from .callbacks import Callback
from .events import StepEvent


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
    """Scalars for TensorBoard: ``train/loss``, ``train/lr`` (and ``train/grad_norm``, the
    throughput) on logged updates, ``eval/NAME`` after evaluations, every one at the
    update's number (from 1, as the console and ``metrics.jsonl``): an evaluation after
    update N and update N's loss share the step N. A resumed run drops what was written
    after its checkpoint's update and keeps everything up to it. Needs ``pip install
    leantrain[tensorboard]``."""

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
        if start:  # a resumed run: what was written after update ``start`` goes, update ``start``'s stays
            from torch.utils.tensorboard import SummaryWriter

            self.writer.close()
            self.writer = SummaryWriter(self.log_dir, purge_step=start + 1)

    def on_step(self, event: StepEvent) -> None:
        if event.loss is not None:
            for name, value in step_metrics(event).items():
                self.writer.add_scalar(name, value, event.step)

    def on_eval(self, step: int, results: dict) -> None:
        for name, value in eval_metrics(results).items():
            self.writer.add_scalar(name, value, step)

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


# ------------------------------------------------------------------ trackers
def step_metrics(event: StepEvent) -> dict[str, float]:
    """What a tracker logs for a logged update (``{}`` for one that was not)."""
    if event.loss is None:
        return {}
    out = {"train/loss": event.loss, "train/lr": float(event.state.lr)}
    if event.grad_norm is not None:
        out["train/grad_norm"] = event.grad_norm
    out.update({f"train/{k}": v for k, v in (event.throughput or {}).items()})
    return out


def eval_metrics(results: dict) -> dict[str, float]:
    return {f"eval/{k}": float(v) for k, v in results.items() if math.isfinite(float(v))}


def _need(package: str, who: str, extra: str):
    try:
        return __import__(package)
    except ImportError:
        raise ConfigError(f"{who}: the {package} package is not installed; install it with: "
                          f"pip install 'leantrain[{extra}]'") from None


class WandbLogger(Callback):
    """Log to Weights & Biases. ``project``, ``name``, ``dir``, ``mode`` (``"online"``,
    ``"offline"``, ``"disabled"``), ``tags`` and ``config`` (added to the loop's
    settings) go to ``wandb.init``, and so does any other keyword; ``id`` continues an
    existing run (a resume does so by itself)."""

    reads_only = True

    def __init__(self, project: Optional[str] = None, *, name: Optional[str] = None, dir: Optional[str] = None,
                 mode: Optional[str] = None, tags: Optional[list] = None, config: Optional[dict] = None,
                 id: Optional[str] = None, **init: Any) -> None:
        self.wandb = _need("wandb", "WandbLogger", "wandb")
        self.init = dict(project=project, name=name, dir=None if dir is None else str(dir), mode=mode, tags=tags,
                         **init)
        self.config, self.run_id, self.run = dict(config or {}), id, None

    def state_dict(self) -> dict:
        return {"run_id": self.run_id}

    def load_state_dict(self, state: dict) -> None:
        self.run_id = state.get("run_id") or self.run_id

    def on_config(self, config: dict) -> None:
        self.config = {**config, **self.config}

    def on_begin(self, total: Optional[int], start: int) -> None:
        wandb = self.wandb
        settings = self.init.get("settings") or wandb.Settings(console="off", silent=True)
        self.run_id = self.run_id or uuid.uuid4().hex[:12]  # ours, so a checkpoint can carry it
        given = {k: v for k, v in self.init.items() if v is not None and k != "settings"}
        self.run = wandb.init(id=self.run_id, resume="allow", config=self.config, settings=settings,
                              reinit="create_new", **given)

    def on_step(self, event: StepEvent) -> None:
        values = step_metrics(event)
        if values and self.run is not None:
            self.run.log(values, step=event.step)

    def on_eval(self, step: int, results: dict) -> None:
        if self.run is not None:
            self.run.log(eval_metrics(results), step=step)

    def on_end(self, report) -> None:
        if self.run is not None:
            self.run.summary["steps"] = report.steps
            self.run.finish()
            self.run = None


class MLflowLogger(Callback):
    """Log to MLflow through its client (no global active run is set): ``tracking_uri``
    (``None``: MLflow's default), ``experiment`` (made when missing), ``run_name``,
    ``tags``; ``run_id`` continues an existing run (a resume does so by itself). The
    loop's settings are logged as parameters when the run is made."""

    reads_only = True

    def __init__(self, tracking_uri: Optional[str] = None, *, experiment: str = "leantrain",
                 run_name: Optional[str] = None, tags: Optional[dict] = None, run_id: Optional[str] = None) -> None:
        _need("mlflow", "MLflowLogger", "mlflow")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri)
        self.experiment, self.run_name, self.tags = experiment, run_name, dict(tags or {})
        self.run_id, self.config = run_id, {}

    def state_dict(self) -> dict:
        return {"run_id": self.run_id}

    def load_state_dict(self, state: dict) -> None:
        self.run_id = state.get("run_id") or self.run_id

    def on_config(self, config: dict) -> None:
        self.config = config

    def on_begin(self, total: Optional[int], start: int) -> None:
        from mlflow.entities import Param

        if self.run_id is not None:
            self.client.update_run(self.run_id, status="RUNNING")
            return
        found = self.client.get_experiment_by_name(self.experiment)
        exp = found.experiment_id if found is not None else self.client.create_experiment(self.experiment)
        self.run_id = self.client.create_run(exp, run_name=self.run_name, tags=self.tags).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in self.config.items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def _log(self, values: dict, step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in values.items()]
        if metrics and self.run_id is not None:
            self.client.log_batch(self.run_id, metrics=metrics)

    def on_step(self, event: StepEvent) -> None:
        self._log(step_metrics(event), event.step)

    def on_eval(self, step: int, results: dict) -> None:
        self._log(eval_metrics(results), step)

    def on_end(self, report) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status="FINISHED")
