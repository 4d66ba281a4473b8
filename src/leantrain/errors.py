"""Exception types and the message helpers every check uses.

Every error leantrain raises on bad input is a ``LeantrainError`` that also
subclasses the builtin a user would catch (``ValueError`` or ``TypeError``).
Messages read ``operation: slot i ('name'): expected X, got Y``.
"""

from __future__ import annotations

from typing import Optional

__all__ = [
    "LeantrainError", "PackError", "PackTypeError", "AliasError", "ConfigError", "OptimizerStateError", "DataError",
    "CheckpointError", "NonFiniteError", "CollectiveError", "ReplicaError",
]


class LeantrainError(Exception):
    """Base class of every error leantrain raises on purpose."""


class PackError(LeantrainError, ValueError):
    """A tensor pack, mask or slot map does not fit the parameter list."""


class PackTypeError(LeantrainError, TypeError):
    """A pack entry is not a tensor (or not the right kind of object)."""


class AliasError(LeantrainError, ValueError):
    """Storages overlap partially, or a re-tie would merge separate histories."""


class ConfigError(LeantrainError, ValueError):
    """A hyperparameter, schedule, loop setting or sample is invalid."""


class OptimizerStateError(LeantrainError, ValueError):
    """An optimizer state does not belong to this optimizer, layout or update path."""


class DataError(LeantrainError, ValueError):
    """A dataset, batch or loader setting is unusable (empty, zero batch size...)."""


class CheckpointError(LeantrainError, ValueError):
    """A checkpoint file is missing, corrupt, or does not fit the destination."""


class NonFiniteError(LeantrainError, FloatingPointError):
    """A loss or gradient is NaN or infinite and the loop was told to raise."""


class CollectiveError(LeantrainError, RuntimeError):
    """A collective operation failed mid-run under ``torch.distributed`` (a rank died,
    stopped or timed out): the message names the operation, this rank, the update and the
    last good checkpoint."""


class ReplicaError(LeantrainError, RuntimeError):
    """The ranks do not hold the same parameters."""


def slot_label(index: int, name: Optional[str]) -> str:
    """``slot 3 ('decoder.weight')`` or ``slot 3`` for an unnamed slot."""
    return f"slot {index} ({name!r})" if name else f"slot {index}"


def shape_str(shape) -> str:
    """Shapes print as tuples: ``(512, 64)``, ``()`` for a scalar."""
    return str(tuple(int(d) for d in shape))
