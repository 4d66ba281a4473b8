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


class Record:
    """Base of the records below: ``TENSORS`` names the tensor fields, the rest are scalars."""

    TENSORS: ClassVar[tuple[str, ...]] = ()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The record's tensors by field name (what a checkpoint stores for it)."""
        return {name: getattr(self, name) for name in self.TENSORS}


_STEP = {"step": (int, 0, 2**63 - 1)}
_POSITIVE = (float, 0.0, 1.7976931348623157e308)


@dataclass(frozen=True)
class DampenedMomentumState(Record):
    """SGD momentum with dampening: torch's first step copies the gradient (no dampening)."""
    step: int
    buf: torch.Tensor
    TENSORS = ("buf",)
    SCALARS: ClassVar[dict] = _STEP


@dataclass(frozen=True)
class AdagradStepState(Record):
    """Adagrad with ``lr_decay``: the step count scales the rate, ``lr / (1 + (t-1)*lr_decay)``."""
    step: int
    sum: torch.Tensor
    TENSORS = ("sum",)
    SCALARS: ClassVar[dict] = _STEP


@dataclass(frozen=True)
class AMSGradState(Record):
    step: int
    m: torch.Tensor
    v: torch.Tensor
    vmax: torch.Tensor
    TENSORS = ("m", "v", "vmax")
    SCALARS: ClassVar[dict] = _STEP


@dataclass(frozen=True)
class RMSPropMomentumState(Record):
    avg: torch.Tensor
    buf: torch.Tensor
    TENSORS = ("avg", "buf")


@dataclass(frozen=True)
class RMSPropCenteredState(Record):
    avg: torch.Tensor
    grad_avg: torch.Tensor
    TENSORS = ("avg", "grad_avg")


@dataclass(frozen=True)
class RMSPropCenteredMomentumState(Record):
    avg: torch.Tensor
    grad_avg: torch.Tensor
    buf: torch.Tensor
    TENSORS = ("avg", "grad_avg", "buf")


@dataclass(frozen=True)
class NAdamState(Record):
    step: int
    m: torch.Tensor
    v: torch.Tensor
    mu_product: float = 1.0  # a binary32 value (torch keeps it as a float32 scalar tensor)
    TENSORS = ("m", "v")
    SCALARS: ClassVar[dict] = {**_STEP, "mu_product": (float, 0.0, 1.0)}


@dataclass(frozen=True)
class RAdamState(Record):
    step: int
    m: torch.Tensor
    v: torch.Tensor
    TENSORS = ("m", "v")
    SCALARS: ClassVar[dict] = _STEP


@dataclass(frozen=True)
class AdamaxState(Record):
    step: int
    m: torch.Tensor
    u: torch.Tensor  # torch's exp_inf
    TENSORS = ("m", "u")
    SCALARS: ClassVar[dict] = _STEP


@dataclass(frozen=True)
class ASGDState(Record):
    step: int
    ax: torch.Tensor
    eta: float  # binary32 values, as torch's scalar tensors
    mu: float = 1.0
    TENSORS = ("ax",)
    SCALARS: ClassVar[dict] = {**_STEP, "eta": _POSITIVE, "mu": _POSITIVE}


@dataclass(frozen=True)
class RpropState(Record):
    step: int
    prev: torch.Tensor
    step_size: torch.Tensor
    TENSORS = ("prev", "step_size")
    SCALARS: ClassVar[dict] = _STEP


@dataclass(frozen=True)
class MuonState(Record):
    buf: torch.Tensor
    TENSORS = ("buf",)


def _row(shape: tuple) -> tuple:
    return tuple(shape[:-1]) + (1,)


def _column(shape: tuple) -> tuple:
    return tuple(shape[:-2]) + (1,) + tuple(shape[-1:])


@dataclass(frozen=True)
class AdafactorState(Record):
    """Adafactor on a tensor of 2 or more dimensions: the factored second moment, one
    value per row and one per column (torch's ``row_var``, ``col_var``)."""
    step: int
    row_var: torch.Tensor
    col_var: torch.Tensor
    TENSORS = ("row_var", "col_var")
    SCALARS: ClassVar[dict] = _STEP
    SHAPES: ClassVar[dict] = {"row_var": _row, "col_var": _column}


@dataclass(frozen=True)
class AdafactorVectorState(Record):
    """Adafactor on a vector or a scalar: the whole second moment (torch's ``variance``)."""
    step: int
    variance: torch.Tensor
    TENSORS = ("variance",)
    SCALARS: ClassVar[dict] = _STEP


def state_shape(record: type, name: str, shape: tuple) -> tuple:
    """The shape of a record's tensor ``name`` for a parameter of ``shape``: the
    parameter's own, except where the record says otherwise (Adafactor's factors)."""
    pick = getattr(record, "SHAPES", {}).get(name)
    return tuple(shape) if pick is None else pick(tuple(shape))


def parameter_shaped(record: type, name: str) -> bool:
    """Whether the record's tensor ``name`` has its parameter's shape (and layout)."""
    return name not in getattr(record, "SHAPES", {})


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
