"""leantrain: the TorchLean trainer runtime on PyTorch.

Shape-indexed parameter packs with explicit host/device ownership, tied and
frozen slots, exact optimizers, and supervised loops that follow a written
contract.
"""

from . import optim
from .config import LoaderTrainConfig, TrainConfig, TrainReport
from .data import DataLoader, Dataset
from .errors import (
    AliasError,
    CheckpointError,
    ConfigError,
    DataError,
    LeantrainError,
    NonFiniteError,
    OptimizerStateError,
    PackError,
    PackTypeError,
)
from .packs import add_gradient_packs, canonical_gradient, canonical_gradients, scale_gradient_pack
from .params import Param, ParamList
from .runner import Runner
from .schema import ParameterSchema
from .steps import mean_gradients, mean_loss_and_gradients, step_batch, step_batch_and_loss
from .storage import Storage
from .checkpoint import Checkpoint, load_checkpoint, read_checkpoint, save_checkpoint
from .loader_training import run_loader_epochs, train_loader
from .trainer import StepEvent, run_sample_steps, train_dataset, train_samples

__version__ = "0.1.0"

__all__ = [
    "optim",
    "Param", "ParamList", "Storage", "ParameterSchema",
    "canonical_gradients", "canonical_gradient", "add_gradient_packs", "scale_gradient_pack",
    "Runner", "Dataset", "DataLoader",
    "TrainConfig", "LoaderTrainConfig", "TrainReport",
    "mean_gradients", "mean_loss_and_gradients", "step_batch", "step_batch_and_loss",
    "run_sample_steps", "train_samples", "train_dataset", "run_loader_epochs", "train_loader",
    "StepEvent", "save_checkpoint", "load_checkpoint", "read_checkpoint", "Checkpoint",
    "LeantrainError", "PackError", "PackTypeError", "AliasError", "ConfigError",
    "OptimizerStateError", "DataError", "CheckpointError", "NonFiniteError",
    "__version__",
]
