"""leantrain: the TorchLean trainer runtime on PyTorch.

Shape-indexed parameter packs with explicit host/device ownership, tied and
frozen slots, exact optimizers, and supervised loops that follow a written
contract.
"""

import sys as _sys

from . import collate, metrics, optim
from .check import CheckReport, check
from .data import DataLoader, Dataset
from .errors import (
    AliasError,
    CheckpointError,
    CollectiveError,
    ConfigError,
    DataError,
    LeantrainError,
    NonFiniteError,
    OptimizerStateError,
    PackError,
    PackTypeError,
    ReplicaError,
)
from .io import torchlean as torchlean_io
from .io import weights
from .io.checkpoint import read_checkpoint, save_checkpoint
from .io.loading import Checkpoint, load_checkpoint
from .params import (
    Param,
    ParameterSchema,
    ParamList,
    Storage,
    add_gradient_packs,
    canonical_gradient,
    canonical_gradients,
    scale_gradient_pack,
)
from .training.loops.callbacks import Callback, EarlyStopping, ProgressBar
from .training.runner.averaging import Averaging
from .training.loops.loggers import CSVLogger, JSONLLogger, MLflowLogger, TensorBoardLogger, WandbLogger
from .training.loops.config import LoaderTrainConfig, TrainConfig, TrainReport
from .training.loops.checkpointing import CheckpointOptions
from .training.loops.evaluator import EvalOptions
from .training.parallel.strategy import ParallelOptions
from .training.parallel.engines import DDP, FSDP2
from .training.loops.evaluation import evaluate, predict
from .training.loops.run_options import seed_everything
from .training.loops.loader_loop import run_loader_epochs, train_loader
from .training.loops.sample_loop import run_sample_steps, train_dataset, train_samples
from .training.loops.events import StepEvent
from .training.runner.runner import Runner
from .samples import LossSum, label_smoothed, split_rows
from .training.loops.calls import mean_gradients, mean_loss_and_gradients, step_batch, step_batch_and_loss
from .lr_finder import LRFinderResult, find_lr
from .batch_size_finder import BatchSizeResult, find_batch_size

# The documented module paths ``leantrain.weights`` and ``leantrain.torchlean_io`` name
# modules that live in ``leantrain.io``; both spellings import the same module object.
_sys.modules[__name__ + ".weights"] = weights
_sys.modules[__name__ + ".torchlean_io"] = torchlean_io

__version__ = "0.1.0"

__all__ = [
    "optim",
    "Param", "ParamList", "Storage", "ParameterSchema",
    "canonical_gradients", "canonical_gradient", "add_gradient_packs", "scale_gradient_pack",
    "Runner", "LossSum", "split_rows", "Dataset", "DataLoader",
    "TrainConfig", "LoaderTrainConfig", "TrainReport", "CheckpointOptions", "EvalOptions", "ParallelOptions",
    "DDP",
    "FSDP2",
    "mean_gradients", "mean_loss_and_gradients", "step_batch", "step_batch_and_loss",
    "run_sample_steps", "train_samples", "train_dataset", "run_loader_epochs", "train_loader",
    "StepEvent", "save_checkpoint", "load_checkpoint", "read_checkpoint", "Checkpoint",
    "LeantrainError", "PackError", "PackTypeError", "AliasError", "ConfigError",
    "OptimizerStateError", "DataError", "CheckpointError", "NonFiniteError", "CollectiveError", "ReplicaError",
    "evaluate", "metrics", "Callback", "EarlyStopping", "Averaging", "label_smoothed", "ProgressBar", "JSONLLogger", "CSVLogger",
    "TensorBoardLogger", "WandbLogger", "MLflowLogger", "predict", "find_lr", "LRFinderResult", "find_batch_size", "BatchSizeResult",
    "seed_everything", "weights", "torchlean_io", "check", "CheckReport", "collate",
    "__version__",
]
