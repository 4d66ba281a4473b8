"""What a torch user hands an optimizer, as leantrain's parameter list: a module, an
iterable of Parameters (or of ``(name, Parameter)`` pairs), or torch-style param groups
(a list of dicts, each with ``params`` and its own hyperparameters by torch's names).
The tensors are the user's own (updated in place, never copied); a tensor listed twice is
one slot's storage seen twice (a tie). Groups become per-slot settings: the group's
options (numbers and flags, by torch's names) as overrides; each group keeps its own
rate, exactly (``Optimizer.group_lrs``; a group without ``lr`` has the optimizer's), as
torch's param groups do: ``OptState.lrs`` holds every group's rate, which a schedule
advances group by group.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..errors import ConfigError
from ..params.module_slots import view_key
from ..params.param import Param
from ..params.paramlist import ParamList
from ..params.storage import Storage

# torch's group keys -> leantrain's record fields (pairs split in two)
PAIRS = {"betas": ("beta1", "beta2"), "etas": ("etaminus", "etaplus"),
         "step_sizes": ("step_size_min", "step_size_max"), "adamw_betas": ("adamw_beta1", "adamw_beta2")}
RENAMES = {"rmsprop": {"alpha": "decay"}}
IGNORED = ("foreach", "fused", "capturable", "differentiable", "initial_lr", "param_names")


def _tensors(op: str, value: object, where: str) -> tuple[list, list]:
    """(names or None, tensors) of a ``params`` value."""
    if isinstance(value, torch.Tensor):
        return [None], [value]
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise ConfigError(f"{op}: {where} must be an iterable of tensors, got {type(value).__name__}")
    items = list(value)
    named = [isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) for x in items]
    if any(named) and not all(named):
        raise ConfigError(f"{op}: {where} mixes named (name, tensor) pairs and bare tensors; use one form")
    names = [x[0] for x in items] if any(named) else [None] * len(items)
    tensors = [x[1] for x in items] if any(named) else items
    for k, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"{op}: {where}[{k}] is a {type(t).__name__}, not a tensor")
        if not t.is_leaf:
            raise ConfigError(f"{op}: {where}[{k}] is not a leaf tensor; an optimizer updates leaves only")
    return names, tensors


def as_param_list(op: str, target: object) -> tuple[ParamList, Optional[list]]:
    """``(params, per slot (its group's index, the group's options), or None)`` for what a
    user passed (``None``: one group, with no options of its own)."""
    if isinstance(target, ParamList):
        return target, None
    if isinstance(target, torch.nn.Module):
        return ParamList.from_module(target), None
    if hasattr(target, "params") and isinstance(getattr(target, "params"), ParamList):
        return target.params, None  # a Runner
    if isinstance(target, torch.Tensor):
        raise ConfigError(f"{op}: params must be an iterable of tensors or param groups, got a single Tensor "
                          f"(wrap it in a list)")
    if isinstance(target, (str, bytes, dict)) or not hasattr(target, "__iter__"):
        raise ConfigError(f"{op}: expected a ParamList, a module, an iterable of Parameters or param groups, "
                          f"got {type(target).__name__}")
    items = list(target)
    if not items:
        raise ConfigError(f"{op}: got an empty parameter list")
    if all(isinstance(x, dict) for x in items):
        groups = items
    elif any(isinstance(x, dict) for x in items):
        raise ConfigError(f"{op}: params mixes param groups (dicts) and tensors; use one form")
    else:
        groups = [{"params": items}]
    slots, options, seen, named_groups = [], [], {}, set()
    for k, group in enumerate(groups):
        if "params" not in group:
            raise ConfigError(f"{op}: param group {k} has no 'params'")
        names, tensors = _tensors(op, group["params"], f"param group {k} 'params'" if len(groups) > 1 else "params")
        if not tensors and len(groups) > 1:
            raise ConfigError(f"{op}: param group {k} has no parameters (a group's schedule and options need one)")
        named_groups.add(names[0] is not None if names else None)
        extra = {key: v for key, v in group.items() if key != "params"}
        for name, t in zip(names, tensors):
            key = (id(t),)
            if key in seen:
                raise ConfigError(f"{op}: a parameter appears more than once ({name or 'a tensor'} in param group "
                                  f"{k}, first in param group {seen[key]})")
            seen[key] = k
            slots.append((name, t))
            options.append((k, extra))
    if len(named_groups - {None}) > 1:
        raise ConfigError(f"{op}: some param groups name their parameters and some do not; use one form")
    storages: dict[tuple, Storage] = {}
    views = []
    for name, t in slots:
        storage = storages.setdefault(view_key(t), Storage(t))
        # every listed tensor is one the optimizer may update (as torch's: those without a
        # gradient are left alone at each step)
        views.append(Param.of_storage(storage, requires_grad=True, name=name))
    params = ParamList(views)
    return params, options if len(groups) > 1 or any(o for _, o in options) else None


def overrides(op: str, kind: str, options: dict) -> dict:
    """A group's options as per-slot overrides of leantrain's fields (its ``lr`` is the
    group's own rate, kept apart: ``group_rates``)."""
    out: dict = {}
    for key, value in options.items():
        if key in IGNORED or key == "lr":
            continue
        if key in PAIRS:
            if not (isinstance(value, (tuple, list)) and len(value) == 2):
                raise ConfigError(f"{op}: param group option {key} must be a pair, got {value!r}")
            out.update(zip(PAIRS[key], value))
        elif kind == "adamw" and key == "decoupled_weight_decay":
            if value is not True:  # torch's AdamW groups say True: AdamW's decay is decoupled
                raise ConfigError(f"{op}: a param group sets decoupled_weight_decay={value!r}: AdamW's decay is "
                                  f"decoupled; for an L2 penalty use optim.adam(weight_decay=...)")
        else:
            out[RENAMES.get(kind, {}).get(key, key)] = value
    return out


def group_rates(op: str, base_lr: float, options: list) -> tuple[float, ...]:
    """Each group's rate (its ``lr``, else the optimizer's), from the per-slot (group,
    options) pairs: one per group, in the groups' order."""
    rates: dict[int, float] = {}
    for k, o in options:
        value = o.get("lr", base_lr)
        value = value.item() if isinstance(value, torch.Tensor) else value
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0 or value == float("inf"):
            raise ConfigError(f"{op}: param group {k}: lr must be finite and >= 0, got {value!r}")
        rates[k] = float(value)
    return tuple(rates[k] for k in sorted(rates))


def group_function(op: str, kind: str, params: ParamList, options: list) -> tuple[Callable, Callable, tuple]:
    """``(per-slot function, group of a slot, each group's overrides)`` (``Optimizer.per_slot``'s
    function giving each slot its group's overrides, and each slot's group index)."""
    by_tensor = {view_key(params[i].storage.host): (k, overrides(op, kind, o)) for i, (k, o) in enumerate(options)}
    each = {k: o for k, o in by_tensor.values()}
    return (lambda p: by_tensor.get(view_key(p.storage.host), (0, {}))[1],
            lambda p: by_tensor.get(view_key(p.storage.host), (0, {}))[0],
            tuple(each.get(k, {}) for k in range(max(each, default=-1) + 1)))
