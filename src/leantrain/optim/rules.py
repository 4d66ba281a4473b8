"""The one table of rules (spec §3): every optimizer kind, its hyperparameter and state
records, found here by checkpoints, the optimizer shell, ``check``, the command and the
tests. The rules themselves live in ``classic_rules.py`` (upstream's five and their torch
options), ``lion_rule.py`` and ``torch_rules.py`` (torch's other optimizers)."""

from __future__ import annotations

import math

from .classic_rules import AdagradRule, AdamRule, SGDRule
from .square_average_rules import AdadeltaRule, RMSPropRule
from .hyper import Hyper
from .lion_rule import LionRule
from .records import (  # noqa: F401  (re-exported: the rules' records live there)
    AdadeltaState, AdagradState, AdamState, LionState, MomentumState, RMSPropState, SGDState, clone_record,
    parameter_shaped, record_scalars, state_shape, tensor_fields,
)
from .torch_rules import RULES as TORCH_RULES, AdafactorRule, MuonRule


def scalar_problems(record_type: str, values: dict) -> list[str]:
    """Why saved scalar fields ``values`` cannot fill a ``record_type`` record: a missing
    or extra field, a wrong type, a value out of its range."""
    spec = getattr(RECORDS[record_type], "SCALARS", {})
    out = [f"unexpected field {k!r}" for k in sorted(set(values) - set(spec))]
    for name, (kind, low, high) in spec.items():
        v = values.get(name)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or isinstance(v, int))
        if not (ok and math.isfinite(v) and low <= v <= high):
            out.append(f"{name}: expected {'an integer' if kind is int else 'a number'} in [{low}, {high}], got {v!r}")
    return out


# ---------------------------------------------------------------------- registry
# The one table of rules. Each declares the hyperparameter records it serves, the
# state records it makes (their class names are their checkpoint names), its upstream
# formula, its torch.optim equivalent and whether it has a native (device) path;
# checkpoints, the optimizer, ``check``, the command and the tests read everything from
# here. A new optimizer: a Hyper record (hyper.py), a state record (records.py), a rule
# here (or in a module of its own: lion_rule.py), a constructor of the kind's name (optim/__init__.py).
RULES = (SGDRule, AdagradRule, RMSPropRule, AdamRule, AdadeltaRule, LionRule) + TORCH_RULES

_BY_HYPER = {h: rule for rule in RULES for h in rule.hypers}
HYPERS: dict[str, type] = {h.kind: h for rule in RULES for h in rule.hypers}
RECORDS: dict[str, type] = {r.__name__: r for rule in RULES for r in rule.records}


def rule_for(h: Hyper):
    return _BY_HYPER[type(h)]


SHAPED = (MuonRule, AdafactorRule)  # their record depends on the slot's shape


def record_type(h: Hyper, shape=None) -> type:
    """The state record a rule keeps for ``h``, from its declaration (no tensor made):
    the rule's one record, or what its ``record_type`` picks (SGD: momentum or not; Muon:
    by the slot's ``shape``, a matrix or not)."""
    rule = rule_for(h)
    pick = getattr(rule, "record_type", None)
    if pick is None:
        return rule.records[0]
    return pick(h, shape) if rule in SHAPED else pick(h)


def elementwise(h: Hyper) -> bool:
    """Whether the rule updates each element from that element alone (sharding may cut
    its tensors; Muon's Newton-Schulz needs the whole matrix)."""
    return getattr(rule_for(h), "elementwise", True)
