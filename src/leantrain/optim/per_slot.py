"""Per-slot hyperparameters: ``opt.per_slot(fn)``.

``fn(param)`` is called for every trainable slot (a ``Param``: ``.name``, ``.shape``,
``.dtype``) and returns a dict of overrides: the rule's own hyperparameters (not ``lr``:
schedules own it; not ``numerics``) and ``lr_scale``, which multiplies the scheduled rate.
``{}`` keeps the base values. Every occurrence of a tie must ask for the same thing (one
storage has one history). Each resolved record is validated like the base (ranges, then
again after rounding to the slot's dtype) and must keep the base's state layout (SGD's
momentum may change, not switch on or off). All of it before anything is written.
"""

from __future__ import annotations

import math
from dataclasses import fields, replace
from typing import Callable, Optional

import torch

from ..errors import AliasError, ConfigError
from ..validate import is_number
from .hyper import Hyper
from .rules import record_type

Settings = list[Optional[tuple[Hyper, float]]]  # per slot: (record, lr_scale); None: frozen


def allowed_keys(base: Hyper) -> set[str]:
    return {f.name for f in fields(base)} - {"lr", "numerics"} | {"lr_scale"}


def resolve(op: str, base: Hyper, fn: Callable, params) -> tuple[Settings, tuple]:
    """Each slot's (hyper, lr_scale) and the overrides as asked (a hashable record of
    them: what a checkpoint stores and a resume compares). Raises before any change."""
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
            if not (is_number(v) and math.isfinite(v)):
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
        layout = record_type(base, tuple(params[i].shape))
        if record_type(h, tuple(params[i].shape)) is not layout:
            raise ConfigError(f"{op}: {where}: {rest} changes the optimizer state's layout "
                              f"(from {layout.__name__}); choose values that keep it")
        settings[i] = (h, scale)
    record = tuple((i, tuple(a.items())) for i, a in enumerate(asked) if a and reps[i] == i)
    return settings, record


def plain(base: Hyper, params) -> Settings:
    """Every trainable slot on the base record (no per-slot function)."""
    return [None if c is None else (base, 1.0) for c in params.canonical_slot_indices()]
