"""Hyperparameter records of the rules leantrain runs through torch.optim's own
implementations (``torch_rules.py``): NAdam, RAdam, Adamax, ASGD, Rprop and Muon. Field
names are torch's (Adafactor's ``eps`` pair is ``eps1``/``eps2``), but ``betas``, ``etas`` and ``step_sizes`` are two fields each
(``beta1``/``beta2``...), as in the other records; the constructors take both spellings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError
from ..validate import is_int, is_number
from .hyper import Hyper


@dataclass(frozen=True)
class NAdam(Hyper):
    """NAdam (Dozat 2016): Adam with Nesterov momentum and torch's momentum-decay schedule."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum_decay: float = 4e-3
    decoupled_weight_decay: bool = False
    maximize: bool = False
    kind = "nadam"  # its constructor: optim.nadam
    torch_name = 'NAdam'  # its torch.optim class
    _units = ("beta1", "beta2")
    _eps = ("eps",)
    _rates = ("lr", "weight_decay", "momentum_decay")
    _flags = ("decoupled_weight_decay", "maximize")


@dataclass(frozen=True)
class RAdam(Hyper):
    """RAdam (Liu et al. 2019): Adam with the variance rectification term."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = False
    maximize: bool = False
    kind = "radam"  # its constructor: optim.radam
    torch_name = 'RAdam'  # its torch.optim class
    _units = ("beta1", "beta2")
    _eps = ("eps",)
    _rates = ("lr", "weight_decay")
    _flags = ("decoupled_weight_decay", "maximize")


@dataclass(frozen=True)
class Adamax(Hyper):
    """Adamax (Kingma & Ba 2015): Adam with an infinity-norm second moment."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    maximize: bool = False
    kind = "adamax"  # its constructor: optim.adamax
    torch_name = 'Adamax'  # its torch.optim class
    _units = ("beta1", "beta2")
    _eps = ("eps",)
    _rates = ("lr", "weight_decay")
    _flags = ("maximize",)


@dataclass(frozen=True)
class ASGD(Hyper):
    """Averaged SGD (Polyak & Juditsky 1992), torch's form: the average is kept as ``ax``."""

    lambd: float = 1e-4
    alpha: float = 0.75
    t0: float = 1e6
    weight_decay: float = 0.0
    maximize: bool = False
    kind = "asgd"  # its constructor: optim.asgd
    torch_name = 'ASGD'  # its torch.optim class
    _rates = ("lr", "lambd", "alpha", "t0", "weight_decay")
    _flags = ("maximize",)


@dataclass(frozen=True)
class Rprop(Hyper):
    """Rprop: per-element step sizes adapted to the gradient's sign (``etas``, ``step_sizes``)."""

    etaminus: float = 0.5
    etaplus: float = 1.2
    step_size_min: float = 1e-6
    step_size_max: float = 50.0
    maximize: bool = False
    kind = "rprop"  # its constructor: optim.rprop
    torch_name = 'Rprop'  # its torch.optim class
    _rates = ("lr", "etaminus", "etaplus", "step_size_min", "step_size_max")
    _flags = ("maximize",)

    def check_more(self, op: str) -> None:
        if not 0.0 < self.etaminus < 1.0 < self.etaplus:
            raise ConfigError(f"{op}: etas must satisfy 0 < etaminus < 1 < etaplus, got ({self.etaminus!r}, "
                              f"{self.etaplus!r})")
        if self.step_size_min > self.step_size_max:
            raise ConfigError(f"{op}: step_size_min {self.step_size_min!r} is above step_size_max "
                              f"{self.step_size_max!r}")


@dataclass(frozen=True)
class Adafactor(Hyper):
    """Adafactor (Shazeer & Stern 2018), torch's form: a factored second moment on
    tensors of 2 or more dimensions, the relative step ``min(lr, 1/sqrt(t))`` scaled by
    the parameter's RMS, update clipping at ``d``. ``eps1=None``: the dtype's epsilon."""

    beta2_decay: float = -0.8
    eps1: Optional[float] = None
    eps2: float = 1e-3
    d: float = 1.0
    weight_decay: float = 0.0
    maximize: bool = False
    kind = "adafactor"  # its constructor: optim.adafactor
    torch_name = 'Adafactor'  # its torch.optim class
    _rates = ("lr", "eps2", "weight_decay")
    _flags = ("maximize",)
    _fused = True  # no eps is added to a stored intermediate

    def check_more(self, op: str) -> None:
        if not (is_number(self.beta2_decay) and math.isfinite(self.beta2_decay) and self.beta2_decay <= 0):
            raise ConfigError(f"{op}: beta2_decay must be a finite number <= 0, got {self.beta2_decay!r}")
        if self.eps1 is not None and not (is_number(self.eps1) and math.isfinite(self.eps1) and self.eps1 >= 0):
            raise ConfigError(f"{op}: eps1 must be None or a finite number >= 0, got {self.eps1!r}")
        if not (is_number(self.d) and math.isfinite(self.d) and self.d >= 1):
            raise ConfigError(f"{op}: d (the clipping threshold) must be a finite number >= 1, got {self.d!r}")
        object.__setattr__(self, "beta2_decay", float(self.beta2_decay))
        object.__setattr__(self, "d", float(self.d))


ADJUST_LR = ("original", "match_rms_adamw")


@dataclass(frozen=True)
class Muon(Hyper):
    """Muon on every 2-D slot (Newton-Schulz on the whole matrix, torch.optim.Muon's
    implementation); every other slot (vectors, scalars, higher-rank tensors) takes the
    fallback rule, AdamW with ``adamw_beta1``, ``adamw_beta2``, ``adamw_eps``, the same
    ``lr`` and ``weight_decay`` (per_slot changes either per slot)."""

    weight_decay: float = 0.1
    momentum: float = 0.95
    nesterov: bool = True
    ns_a: float = 3.4445
    ns_b: float = -4.7750
    ns_c: float = 2.0315
    eps: float = 1e-7
    ns_steps: int = 5
    adjust_lr_fn: str = "original"
    adamw_beta1: float = 0.9
    adamw_beta2: float = 0.999
    adamw_eps: float = 1e-8
    tensor_lr: bool = False  # lr was given as a tensor: torch then scales it as a float32 tensor (shape ratio, decay)
    kind = "muon"  # its constructor: optim.muon
    _forms = ()  # torch's Muon has one form
    _added = ("tensor_lr",)
    torch_name = 'Muon'  # its torch.optim class
    _fused = True  # eps clamps a bfloat16 norm (float32's range), adamw_eps goes to the fused AdamW kernel
    _rates = ("lr", "weight_decay", "momentum")
    _units = ("adamw_beta1", "adamw_beta2")
    _eps = ("eps", "adamw_eps")
    _flags = ("nesterov", "tensor_lr")

    def check_more(self, op: str) -> None:
        for name in ("ns_a", "ns_b", "ns_c"):
            v = getattr(self, name)
            if not (is_number(v) and math.isfinite(v)):
                raise ConfigError(f"{op}: {name} (a Newton-Schulz coefficient) must be a finite number, got {v!r}")
            object.__setattr__(self, name, float(v))
        if not (is_int(self.ns_steps) and 0 <= self.ns_steps < 100):
            raise ConfigError(f"{op}: ns_steps must be an integer in [0, 100), got {self.ns_steps!r}")
        if self.adjust_lr_fn not in ADJUST_LR:
            raise ConfigError(f"{op}: adjust_lr_fn must be one of {ADJUST_LR} (or None: 'original'), got "
                              f"{self.adjust_lr_fn!r}")
