"""Scalars for TensorBoard and the experiment trackers (Weights & Biases, MLflow): the
same names and update numbers as the files' records (see the package's docstring)."""

from __future__ import annotations

import math
import posixpath
import re
import time
import uuid
from typing import Any, Optional

from ....errors import ConfigError
from ..callbacks import Callback
from ..events import StepEvent


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


_MLFLOW_NAME = re.compile(r"[/\w.\- :]*")


class MLflowLogger(Callback):
    """Log to MLflow through its client (no global active run is set): ``tracking_uri``
    (``None``: MLflow's default: on MLflow 3 ``sqlite:///mlflow.db`` in the current folder,
    which the ``leantrain[mlflow]`` extra's SQLAlchemy opens; MLflow 3 refuses a
    ``file://`` store unless ``MLFLOW_ALLOW_FILE_STORE=true``), ``experiment`` (made when
    missing), ``run_name``, ``tags``; ``run_id`` continues an existing run (a resume does so
    by itself). The store is opened when the logger is made (one that cannot be used is a
    ``ConfigError`` then); the loop's settings are logged as parameters when the run is made."""

    reads_only = True

    def __init__(self, tracking_uri: Optional[str] = None, *, experiment: str = "leantrain",
                 run_name: Optional[str] = None, tags: Optional[dict] = None, run_id: Optional[str] = None) -> None:
        _need("mlflow", "MLflowLogger", "mlflow")
        from mlflow.tracking import MlflowClient

        try:  # the store is opened now: one that cannot be used is refused before the run starts
            self.client = MlflowClient(tracking_uri)
            self.client.search_experiments(max_results=1)
        except Exception as e:  # MLflow's own refusal (a file store without its switch, a missing driver)
            uri = tracking_uri or "MLflow's default store"
            raise ConfigError(f"MLflowLogger: the tracking store {uri!s} cannot be used: "
                              f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None
        self.experiment, self.run_name, self.tags = experiment, run_name, dict(tags or {})
        self.run_id, self.config = run_id, {}

    def state_dict(self) -> dict:
        return {"run_id": self.run_id}

    def load_state_dict(self, state: dict) -> None:
        self.run_id = state.get("run_id") or self.run_id

    def check_names(self, op: str, results: set) -> None:
        """MLflow's rule for a metric's name (letters, digits, ``_ - . : /`` and spaces; no
        ``..`` or a leading ``/``; at most 250 characters), checked before the run."""
        for name in sorted(f"eval/{k}" for k in results):
            norm = posixpath.normpath(name)
            if not _MLFLOW_NAME.fullmatch(name) or norm != name or norm.startswith(("..", "/")) or len(name) > 250:
                raise ConfigError(f"{op}: MLflowLogger: the metric {name!r} breaks MLflow's naming rule (letters, "
                                  f"digits, _ - . : / and spaces, no '..', at most 250 characters); rename the "
                                  f"evaluation set or metric")

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
