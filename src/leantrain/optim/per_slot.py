"""Per-slot hyperparameters: ``opt.per_slot(fn)``, and torch-style param groups.

``fn(param)`` is called for every trainable slot (a ``Param``: ``.name``, ``.shape``,
``.dtype``) and returns a dict of overrides: the rule's own hyperparameters, numbers and
flags alike (``amsgrad``, ``nesterov``, ``maximize``...; not ``lr``: schedules own it;
not ``numerics``), and ``lr_scale``, which multiplies the scheduled rate. ``{}`` keeps
the base values. Every occurrence of a tie must ask for the same thing (one storage has
one history). Each resolved record is validated like the base (ranges, then again after
rounding to the slot's dtype); a setting may change a slot's state record (SGD momentum
on for some slots, AMSGrad for others), as torch's param groups may. All of it before
anything is written.

Each slot resolves to a ``SlotSetting``: its hyperparameters, its ``lr_scale`` and the
param group it belongs to (torch-style groups, ``torch_style.py``; 0 otherwise), whose
own rate a schedule may set (``OptState.lrs``).
"""

from __future__ import annotations

import math
from dataclasses import fields, replace
from typing import Callable, NamedTuple, Optional

import torch

from ..errors import AliasError, ConfigError
from ..validate import is_number
from .hyper import Hyper


class SlotSetting(NamedTuple):
    """What one trainable slot is updated with: its hyperparameters, the factor on its
    group's rate (``lr_scale``) and its param group (whose rate a schedule may set)."""

    hyper: Hyper
    scale: float = 1.0
    group: int = 0


Settings = list[Optional[SlotSetting]]  # per slot; None: frozen


def allowed_keys(base: Hyper) -> set[str]:
    return {f.name for f in fields(base)} - {"lr", "numerics"} | {"lr_scale"}


def resolve(op: str, base: Hyper, fn: Callable, params, group_of: Optional[Callable] = None
            ) -> tuple[Settings, tuple]:
    """Each slot's ``SlotSetting`` and the overrides as asked (a hashable record of them:
    what a checkpoint stores and a resume compares); ``group_of(param)``: the slot's param
    group (torch-style groups). Raises before any change."""
    reps = params.canonical_slot_indices()
    settings: Settings = [None] * len(params)
    asked: list[Optional[dict]] = [None] * len(params)
    keys = allowed_keys(base)
    for i, c in enumerate(reps):
        if c is None:
            continue
        where = params.label(i)
        try:
            raw = fn(params[i])
        except Exception as e:  # the user's function: its failure named by the slot it failed on
            raise ConfigError(f"{op}: {where}: the per-slot function raised {type(e).__name__}: {e}") from e
        if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
            raise ConfigError(f"{op}: {where}: the per-slot function returned {type(raw).__name__}, expected a dict")
        bad = sorted(set(raw) - keys)
        if bad:
            raise ConfigError(f"{op}: {where}: unknown hyperparameter(s) {bad}; allowed: {sorted(keys)}")
        for k, v in raw.items():
            if k in base._flags:
                if not isinstance(v, bool):
                    raise ConfigError(f"{op}: {where}: {k} must be True or False, got {v!r}")
            elif not (is_number(v) and math.isfinite(v)):
                raise ConfigError(f"{op}: {where}: {k} must be a finite number, got {v!r}")
        asked[i] = dict(sorted(raw.items()))
        if c != i:
            if asked[i] != asked[c]:
                raise AliasError(
                    f"{op}: {where} shares its storage with {params.label(c)} but asks for {asked[i]}, "
                    f"not {asked[c]}; a tie has one set of hyperparameters"
                )
            settings[i] = settings[c]
            continue
        rest = dict(asked[i])
        scale = float(rest.pop("lr_scale", 1.0))
        if scale < 0:
            raise ConfigError(f"{op}: {where}: lr_scale must be >= 0, got {scale!r}")
        rate = float(torch.tensor(base.lr * scale, dtype=torch.float64).to(params[i].dtype))
        if not math.isfinite(rate):
            raise ConfigError(f"{op}: {where}: lr_scale={scale!r} makes the rate {base.lr * scale!r}, which is not "
                              f"finite in {str(params[i].dtype).removeprefix('torch.')}")
        try:
            h = replace(base, **rest) if rest else base
            h.check_dtype(params[i].dtype)
        except ConfigError as e:
            raise ConfigError(f"{op}: {where}: {e}") from None
        settings[i] = SlotSetting(h, scale, 0 if group_of is None else group_of(params[i]))
    record = tuple((i, tuple(a.items())) for i, a in enumerate(asked) if a and reps[i] == i)
    return settings, record


def plain(base: Hyper, params) -> Settings:
    """Every trainable slot on the base record (no per-slot function)."""
    return [None if c is None else SlotSetting(base) for c in params.canonical_slot_indices()]
