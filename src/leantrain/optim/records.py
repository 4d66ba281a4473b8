"""The typed state records the update rules keep per tensor (spec §3), one type per kind.

Their class names are their checkpoint names (``rules.RECORDS``); the tensors a record
holds are listed by ``tensors()``, its scalar fields are saved beside them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import ClassVar

import torch


# ------------------------------------------------------------------ state records
@dataclass(frozen=True)
class SGDState:
    """Plain SGD keeps no per-tensor state."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """The record's tensors by field name (what a checkpoint stores for it)."""
        return {}


@dataclass(frozen=True)
class MomentumState:
    buf: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]:
        """The record's tensors by field name (what a checkpoint stores for it)."""
        return {"buf": self.buf}


@dataclass(frozen=True)
class AdagradState:
    sum: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]:
        """The record's tensors by field name (what a checkpoint stores for it)."""
        return {"sum": self.sum}


@dataclass(frozen=True)
class RMSPropState:
    avg: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]:
        """The record's tensors by field name (what a checkpoint stores for it)."""
        return {"avg": self.avg}


@dataclass(frozen=True)
class AdamState:
    step: int
    m: torch.Tensor
    v: torch.Tensor
    beta1_power: float = 1.0
    beta2_power: float = 1.0

    # What a saved record may hold: step counts from 0; the powers b^t lie in [0, 1].
    SCALARS: ClassVar[dict] = {"step": (int, 0, 2**63 - 1), "beta1_power": (float, 0.0, 1.0),
                               "beta2_power": (float, 0.0, 1.0)}

    def tensors(self) -> dict[str, torch.Tensor]:
        """The record's tensors by field name (what a checkpoint stores for it)."""
        return {"m": self.m, "v": self.v}


@dataclass(frozen=True)
class AdadeltaState:
    square_avg: torch.Tensor
    delta_avg: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]:
        """The record's tensors by field name (what a checkpoint stores for it)."""
        return {"square_avg": self.square_avg, "delta_avg": self.delta_avg}


@dataclass(frozen=True)
class LionState:
    m: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]:
        """The record's tensors by field name (what a checkpoint stores for it)."""
        return {"m": self.m}


def tensor_fields(record: type) -> list[str]:
    """The names of the tensors a record type holds (its fields but the scalars), sorted."""
    return sorted(f.name for f in fields(record) if f.name not in getattr(record, "SCALARS", {}))


def clone_record(rec):
    """A deep copy of a record (its buffers cloned), for un-tied histories."""
    return replace(rec, **{k: t.clone() for k, t in rec.tensors().items()})


def record_scalars(rec) -> dict:
    """A record's non-tensor fields by name (``step``, ``beta1_power``...): what a
    checkpoint stores beside the tensors."""
    tensors = rec.tensors()
    return {f.name: getattr(rec, f.name) for f in fields(rec) if f.name not in tensors}
