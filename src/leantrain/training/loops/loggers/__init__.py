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

from .files import META, CSVLogger, JSONLLogger, step_offset
from .trackers import MLflowLogger, TensorBoardLogger, WandbLogger, eval_metrics, step_metrics

__all__ = ["JSONLLogger", "CSVLogger", "TensorBoardLogger", "WandbLogger", "MLflowLogger", "step_offset", "META",
           "step_metrics", "eval_metrics"]
