"""Optimizer hyperparameters: one frozen, validated record per optimizer kind (spec §4).

Each record is checked when it is built (lr and weight decay finite and >= 0;
momentum, decay, rho and betas in [0, 1); eps finite and > 0) and again for each
parameter dtype, after rounding to it (``eps=1e-50`` rounds to 0 in float32).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields
from typing import ClassVar, Optional

import torch

from ..errors import ConfigError
from ..validate import check_choice, is_number

NUMERICS = ("fast", "torchlean")
# torch's implementations of one optimizer, by the name the docs use: torch.optim.X(fused=True),
# X(foreach=True), X(foreach=False) (the per-tensor loop, torch's default on CPU).
IMPLEMENTATIONS = ("fused", "foreach", "for-loop")


def _rounded(value: float, dtype: torch.dtype) -> float:
    # A CPU scalar conversion, not a device read: the value never lived on a device.
    return float(torch.tensor(value, dtype=torch.float64).to(dtype).item())


def check_rate(op: str, name: str, value: object) -> float:
    if not is_number(value):
        raise ConfigError(f"{op}: {name} must be a number, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"{op}: {name} must be finite and >= 0, got {value!r}")
    return float(value)


def check_unit(op: str, name: str, value: object) -> float:
    if not is_number(value):
        raise ConfigError(f"{op}: {name} must be a number, got {value!r}")
    if not (0.0 <= value < 1.0):
        raise ConfigError(f"{op}: {name} must be in [0, 1), got {value!r}")
    return float(value)


def check_eps(op: str, name: str, value: object) -> float:
    if not is_number(value):
        raise ConfigError(f"{op}: {name} must be a number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{op}: {name} must be finite and > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Hyper:
    """Base of the per-kind records; ``lr`` is the base learning rate."""

    lr: float
    # "fast" (leantrain's fused order) or "torchlean" (upstream's formulas, host only).
    numerics: str = field(default="fast", kw_only=True)
    # which of torch's implementations the update runs (``None``: leantrain's choice, the
    # optimizers guide's table; torch's ``fused=``/``foreach=`` choose it by name)
    implementation: Optional[str] = field(default=None, kw_only=True)

    kind: ClassVar[str] = "?"  # the kind's name, and its constructor's in leantrain.optim
    torch_name: ClassVar[Optional[str]] = None  # the torch.optim class it ports (None: torch has none)
    _units: ClassVar[tuple[str, ...]] = ()
    _rates: ClassVar[tuple[str, ...]] = ("lr",)
    _eps: ClassVar[tuple[str, ...]] = ()
    _flags: ClassVar[tuple[str, ...]] = ()  # booleans (torch's maximize, nesterov, amsgrad...)
    # Options added after checkpoints of this kind were written: left out of ``as_dict``
    # at their default, so those checkpoints load and default ones keep their bytes.
    _added: ClassVar[tuple[str, ...]] = ()
    # torch options with no upstream formula: numerics="torchlean" refuses them off default.
    _torch_only: ClassVar[tuple[str, ...]] = ()
    # whether the rule runs a fused kernel (float32 arithmetic for half tensors, nothing
    # stored in between) rather than foreach passes (each intermediate stored in the dtype)
    _fused: ClassVar[bool] = False
    # torch's implementations of the kind leantrain can run by name (none: torch has no choice)
    _forms: ClassVar[tuple[str, ...]] = ("foreach", "for-loop")

    @property
    def computes_fused(self) -> bool:
        """Whether the update runs a fused kernel (half tensors computed in float32)."""
        return self._fused and self.implementation in (None, "fused")

    def __post_init__(self) -> None:
        op = f"optim.{self.kind}"
        check_choice(op, "numerics", self.numerics, NUMERICS)
        if self.implementation is not None:
            if self.implementation not in self._forms:
                have = ", ".join(repr(f) for f in self._forms) or "none to choose"
                raise ConfigError(f"{op}: implementation={self.implementation!r}: torch.optim runs {self.kind} as "
                                  f"{have} (fused=True: 'fused', foreach=True: 'foreach', foreach=False: "
                                  f"'for-loop')")
            if self.numerics == "torchlean":
                raise ConfigError(f"{op}: numerics='torchlean' runs upstream's formulas, not one of torch's "
                                  f"implementations; drop implementation (foreach/fused)")
        for name in self._flags:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{op}: {name} must be True or False, got {getattr(self, name)!r}")
        if self.numerics == "torchlean":
            off = [n for n in self._torch_only if getattr(self, n) != _default(type(self), n)]
            if off:
                raise ConfigError(f"{op}: numerics='torchlean' replays upstream's formulas, which have no "
                                  f"{', '.join(off)}; use numerics='fast' (torch's kernels) for those options")
        self.check_more(op)
        for name in self._rates:
            object.__setattr__(self, name, check_rate(op, name, getattr(self, name)))
        for name in self._units:
            object.__setattr__(self, name, check_unit(op, name, getattr(self, name)))
        for name in self._eps:
            object.__setattr__(self, name, check_eps(op, name, getattr(self, name)))

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Repeat the checks after rounding every hyperparameter to the dtype the update
        computes in: the parameter's with ``numerics="torchlean"`` (upstream's formulas);
        with torch's kernels float64 for float64 and float32 otherwise (their ``opmath``:
        bfloat16 and float16 tensors are computed in float32)."""
        if dtype.is_complex:  # docs/guides/optimizers.md, "Complex parameters"
            raise ConfigError(
                f"optim.{self.kind}: a {str(dtype).removeprefix('torch.')} parameter: leantrain's records, "
                f"checkpoints and sharding are real-valued, so complex parameters are refused; torch.optim "
                f"updates a complex tensor as its real view (SGD to rounding), which is yours to register: keep "
                f"the parameter as torch.view_as_real(z) (shape [..., 2]) and use torch.view_as_complex(p) in "
                f"forward")
        if not dtype.is_floating_point:
            raise ConfigError(f"optim.{self.kind}: parameters must be floating point, got {dtype}")
        op = f"optim.{self.kind}"
        shown = str(dtype).removeprefix("torch.")
        stored = dtype  # foreach forms store each intermediate (sqrt(v) + eps...) in it
        if self.numerics == "fast" and dtype != torch.float64:
            dtype = torch.float32
        name = str(dtype).removeprefix("torch.")
        suffix = f" after conversion to {name}" + (" (binary32)" if dtype == torch.float32 else "")
        if shown != name:
            suffix += f", which torch's kernels compute {shown} in"
        for name in self._eps:
            where, why = (dtype, suffix) if self.computes_fused or self.numerics != "fast" else (
                stored, f" after conversion to {shown} (torch's foreach form keeps its intermediates in it)")
            r = _rounded(getattr(self, name), where)
            if not (math.isfinite(r) and r > 0):
                raise ConfigError(
                    f"{op}: {name} must be finite and > 0{why}, got {getattr(self, name)!r} "
                    f"(rounds to {r!r})"
                )
        for name in self._rates:
            r = _rounded(getattr(self, name), dtype)
            if not math.isfinite(r):
                raise ConfigError(f"{op}: {name} must be finite{suffix}, got {getattr(self, name)!r}")
        for name in self._units:  # 0.999999999 is below 1 in binary64 but 1.0 in binary32
            r = _rounded(getattr(self, name), dtype)
            if not 0.0 <= r < 1.0:
                raise ConfigError(
                    f"{op}: {name} must be in [0, 1){suffix}, got {getattr(self, name)!r} "
                    f"(rounds to {r!r})"
                )

    def check_more(self, op: str) -> None:
        """A kind's own checks beyond the shared ranges (none by default)."""

    @functools.cached_property
    def _binding(self) -> tuple:
        return (self.kind,) + tuple(getattr(self, f.name) for f in fields(self) if f.name != "lr")

    def without_lr(self) -> tuple:
        """The hyperparameters a history is bound to (the lr is the schedule's business)."""
        return self._binding

    def as_dict(self) -> dict[str, object]:
        """The hyperparameters by name (the constructor's keyword arguments); ``numerics``
        only when it is not the default, so default checkpoints keep their exact bytes."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if out["numerics"] == "fast":
            del out["numerics"]
        if out["implementation"] is None:
            del out["implementation"]
        for name in self._added:
            if out[name] == _default(type(self), name):
                del out[name]
        return out

    def describe(self) -> str:
        """The record as a constructor call, e.g. ``adamw(lr=0.001, weight_decay=0.01, ...)``."""
        args = ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items())
        return f"{self.kind}({args})"


def _default(cls: type, name: str) -> object:
    return cls.__dataclass_fields__[name].default


def check_unit_closed(op: str, name: str, value: object) -> float:
    if not is_number(value) or not 0.0 <= value <= 1.0:
        raise ConfigError(f"{op}: {name} must be in [0, 1], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class SGD(Hyper):
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    maximize: bool = False
    kind = "sgd"  # its constructor: optim.sgd
    torch_name = 'SGD'  # its torch.optim class
    _fused = True
    _forms = IMPLEMENTATIONS
    _units = ("momentum",)
    _rates = ("lr", "weight_decay")
    _flags = ("nesterov", "maximize")
    _added = _torch_only = ("dampening", "weight_decay", "nesterov", "maximize")

    def check_more(self, op: str) -> None:
        object.__setattr__(self, "dampening", check_unit_closed(op, "dampening", self.dampening))
        if self.nesterov and (self.momentum == 0.0 or self.dampening != 0.0):
            raise ConfigError(f"{op}: nesterov needs a momentum > 0 and dampening 0, got momentum="
                              f"{self.momentum!r}, dampening={self.dampening!r}")


@dataclass(frozen=True)
class Adagrad(Hyper):
    eps: float = 1e-10
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    maximize: bool = False
    kind = "adagrad"  # its constructor: optim.adagrad
    torch_name = 'Adagrad'  # its torch.optim class
    _fused = True
    _forms = IMPLEMENTATIONS
    _eps = ("eps",)
    _rates = ("lr", "lr_decay", "weight_decay", "initial_accumulator_value")
    _flags = ("maximize",)
    _added = _torch_only = ("lr_decay", "weight_decay", "initial_accumulator_value", "maximize")


@dataclass(frozen=True)
class RMSProp(Hyper):
    decay: float = 0.99  # torch's alpha
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    centered: bool = False
    maximize: bool = False
    kind = "rmsprop"  # its constructor: optim.rmsprop
    torch_name = 'RMSprop'  # its torch.optim class
    _units = ("decay", "momentum")
    _eps = ("eps",)
    _rates = ("lr", "weight_decay")
    _flags = ("centered", "maximize")
    _added = _torch_only = ("weight_decay", "momentum", "centered", "maximize")


@dataclass(frozen=True)
class Adam(Hyper):
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    maximize: bool = False
    decoupled_weight_decay: bool = False  # True: AdamW's decay (torch's Adam option)
    kind = "adam"  # its constructor: optim.adam
    torch_name = 'Adam'  # its torch.optim class
    _fused = True
    _forms = IMPLEMENTATIONS
    _units = ("beta1", "beta2")
    _eps = ("eps",)
    _rates = ("lr", "weight_decay")
    _flags = ("amsgrad", "maximize", "decoupled_weight_decay")
    _added = _torch_only = ("weight_decay", "amsgrad", "maximize", "decoupled_weight_decay")


@dataclass(frozen=True)
class AdamW(Hyper):
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    amsgrad: bool = False
    maximize: bool = False
    kind = "adamw"  # its constructor: optim.adamw
    torch_name = 'AdamW'  # its torch.optim class
    _fused = True
    _forms = IMPLEMENTATIONS
    _rates = ("lr", "weight_decay")
    _units = ("beta1", "beta2")
    _eps = ("eps",)
    _flags = ("amsgrad", "maximize")
    _added = _torch_only = ("amsgrad", "maximize")


@dataclass(frozen=True)
class Adadelta(Hyper):
    rho: float = 0.9
    eps: float = 1e-6
    weight_decay: float = 0.0
    maximize: bool = False
    kind = "adadelta"  # its constructor: optim.adadelta
    torch_name = 'Adadelta'  # its torch.optim class
    _units = ("rho",)
    _eps = ("eps",)
    _rates = ("lr", "weight_decay")
    _flags = ("maximize",)
    _added = _torch_only = ("weight_decay", "maximize")


@dataclass(frozen=True)
class Lion(Hyper):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): the sign of
    an interpolated momentum, decoupled weight decay. No torch.optim equivalent, no
    upstream formula (``numerics="torchlean"`` is refused)."""

    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.0
    kind = "lion"  # its constructor: optim.lion
    _forms = ()  # torch has no Lion
    torch_name = None  # its torch.optim class
    _rates = ("lr", "weight_decay")
    _units = ("beta1", "beta2")
