"""The configuration of ``leantrain train``: a frozen, validated dataclass.

Sources, later wins: the defaults, a TOML file (same keys as the flags, with
underscores), then command-line flags.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .. import optim
from .digits import PRESETS
from ..errors import ConfigError
from ..validate import is_int, is_number

SCHEDULERS = ("none", "step", "exponential", "cosine")
SCHEDULE_PER = ("epoch", "step")
DEVICES = ("cpu", "cuda")
PRECISIONS = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}  # -> the loops' autocast
# The optimizers whose hyperparameters include a weight decay (read from their records).
DECAYING = tuple(kind for kind, h in optim.HYPERS.items() if "weight_decay" in {f.name for f in dataclasses.fields(h)})


@dataclass(frozen=True)
class RunConfig:
    preset: str = "digits-mlp"
    epochs: int = 20
    batch_size: int = 32
    accumulate: int = 1
    optimizer: str = "adam"
    lr: float = 0.002
    scheduler: str = "none"
    seed: int = 0
    device: str = "cpu"
    out: str = "runs/latest"
    log_every: int = 5
    checkpoint_every: int = 100
    model: Optional[str] = None  # "package.module:factory" instead of a preset
    data: Optional[str] = None  # "package.module:function" -> (train, test); default: digits
    loss: str = "cross_entropy"  # "mse", "cross_entropy" or "package.module:function"
    weight_decay: Optional[float] = None  # adamw only
    warmup: int = 1  # warm-up of the cosine schedule: epochs, or updates with schedule_per="step"
    schedule_per: str = "epoch"  # the schedules' index: the epoch (upstream) or the update
    max_steps: Optional[int] = None  # stop after this many updates (mid-epoch if need be)
    exact_reduction: bool = False  # under torchrun: the one-process bits on any number of ranks
    collective_timeout: float = 300.0  # under torchrun: seconds to wait for the slowest rank
    clip_grad_norm: Optional[float] = None  # clip the mean gradient's global L2 norm to this
    ema: Optional[float] = None  # keep a moving average of the weights with this decay
    precision: str = "fp32"  # fp32, bf16 (autocast) or fp16 (autocast and loss scaling)
    decay_matrices_only: bool = False  # adamw: no weight decay on biases and norms (slots below 2-D)
    compile: bool = False  # torch.compile each item's loss and gradients (rounds differently)

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ConfigError:
            return ConfigError(f"--{name.replace('_', '-')}: {rule}, got {getattr(self, name)!r}")

        if not one_of(self.preset, PRESETS):
            raise bad("preset", f"expected one of {', '.join(PRESETS)}")
        for name, low in (("epochs", 1), ("batch_size", 1), ("accumulate", 1), ("seed", 0),
                          ("log_every", 0), ("checkpoint_every", 0)):
            v = getattr(self, name)
            if not is_int(v) or v < low:
                raise bad(name, f"expected an integer >= {low}")
        if self.seed >= 2**64:
            raise bad("seed", "expected an integer below 2**64 (torch's seed range)")
        if not one_of(self.optimizer, optim.OPTIMIZERS):
            raise bad("optimizer", f"expected one of {', '.join(optim.OPTIMIZERS)}")
        if not is_number(self.lr) or not (math.isfinite(self.lr) and self.lr > 0):
            raise bad("lr", "expected a finite number > 0")
        if not one_of(self.scheduler, SCHEDULERS):
            raise bad("scheduler", f"expected one of {', '.join(SCHEDULERS)}")
        if not one_of(self.device, DEVICES):
            raise bad("device", f"expected one of {', '.join(DEVICES)}")
        if not isinstance(self.out, str) or not self.out:
            raise bad("out", "expected a folder path")
        for name in ("model", "data"):
            ref = getattr(self, name)
            if ref is not None and (not isinstance(ref, str) or ":" not in ref):
                raise bad(name, "expected 'package.module:name'")
        if not isinstance(self.loss, str) or (not one_of(self.loss, ("mse", "cross_entropy")) and ":" not in self.loss):
            raise bad("loss", "expected mse, cross_entropy or 'package.module:function'")
        if self.weight_decay is not None:
            if self.optimizer not in DECAYING:
                raise bad("weight_decay", f"only {' and '.join(DECAYING)} take a weight decay")
            if not is_number(self.weight_decay) or not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
                raise bad("weight_decay", "expected a finite number >= 0")
        if not isinstance(self.exact_reduction, bool):
            raise bad("exact_reduction", "expected true or false")
        t = self.collective_timeout
        if not is_number(t) or not (math.isfinite(t) and 0 < t < 10**7):
            raise bad("collective_timeout", "expected seconds > 0")
        c = self.clip_grad_norm
        if c is not None and not (is_number(c) and math.isfinite(c) and c > 0):
            raise bad("clip_grad_norm", "expected a finite number > 0")
        e = self.ema
        if e is not None and not (is_number(e) and math.isfinite(e) and 0 <= e < 1):
            raise bad("ema", "expected a decay in [0, 1)")
        if not isinstance(self.decay_matrices_only, bool):
            raise bad("decay_matrices_only", "expected true or false")
        if self.decay_matrices_only and self.weight_decay is None:
            raise bad("decay_matrices_only", f"needs --weight-decay (with {' or '.join(DECAYING)})")
        if not isinstance(self.compile, bool):
            raise bad("compile", "expected true or false")
        if not one_of(self.precision, PRECISIONS):
            raise bad("precision", f"expected one of {', '.join(PRECISIONS)}")
        if not is_int(self.warmup) or self.warmup < 0:
            raise bad("warmup", "expected an integer >= 0")
        if not one_of(self.schedule_per, SCHEDULE_PER):
            raise bad("schedule_per", f"expected one of {', '.join(SCHEDULE_PER)}")
        if self.max_steps is not None and (not is_int(self.max_steps) or self.max_steps < 1):
            raise bad("max_steps", "expected an integer >= 1")

    @classmethod
    def build(cls, toml_path: Optional[str], overrides: dict[str, Any]) -> "RunConfig":
        values: dict[str, Any] = {}
        if toml_path is not None:
            values.update(read_toml(toml_path))
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @classmethod
    def known_keys(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def make_optimizer(self) -> optim.Optimizer:
        make = optim.OPTIMIZERS[self.optimizer]
        if self.weight_decay is not None:
            opt = make(self.lr, weight_decay=self.weight_decay)
            return opt.per_slot(no_decay_on_vectors) if self.decay_matrices_only else opt
        return make(self.lr)

    def make_schedule(self, steps_per_epoch: int) -> Optional[optim.Schedule]:
        """Indexed by epoch (upstream's rule), or by update with ``schedule_per="step"``:
        then the same curves over the run's updates (``warmup`` counts updates)."""
        per_step = self.schedule_per == "step"
        total = self.epochs * steps_per_epoch if per_step else self.epochs
        if per_step and self.max_steps is not None:
            total = min(total, self.max_steps)
        if self.scheduler == "step":
            return optim.step(self.lr, max(1, total // 3), 0.3)
        if self.scheduler == "exponential":
            return optim.exponential(self.lr, 0.9 ** (1.0 / steps_per_epoch) if per_step else 0.9)
        if self.scheduler == "cosine":
            return optim.warmup_cosine(self.lr, self.lr / 20, self.warmup, max(total, self.warmup + 1))
        return None


def no_decay_on_vectors(p) -> dict:
    """The usual split: weight decay on matrices and kernels, none on biases and norms."""
    return {"weight_decay": 0.0} if len(p.shape) < 2 else {}


def one_of(value: object, choices) -> bool:
    """``value`` is one of the string ``choices`` (a list or a table never is)."""
    return isinstance(value, str) and value in choices


def read_toml(path: str) -> dict[str, Any]:
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not a valid TOML file ({e})") from None
    data = data.get("train", data)  # keys at the top level or under [train]
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: 'train' must be a table ([train] with key = value lines), got {data!r:.60}")
    known = RunConfig.known_keys()
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(known))}")
    return data
