"""What a torch user hands an optimizer, as leantrain's parameter list: a module, an
iterable of Parameters (or of ``(name, Parameter)`` pairs), or torch-style param groups
(a list of dicts, each with ``params`` and its own hyperparameters by torch's names).
The tensors are the user's own (updated in place, never copied); a tensor listed twice is
one slot's storage seen twice (a tie). Groups become per-slot settings: the group's
options as overrides, its ``lr`` as ``lr_scale`` relative to the optimizer's rate.
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
    """``(params, group options per slot or None)`` for what a user passed."""
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
        named_groups.add(names[0] is not None if names else None)
        extra = {key: v for key, v in group.items() if key != "params"}
        for name, t in zip(names, tensors):
            key = (id(t),)
            if key in seen:
                raise ConfigError(f"{op}: a parameter appears more than once ({name or 'a tensor'} in param group "
                                  f"{k}, first in param group {seen[key]})")
            seen[key] = k
            slots.append((name, t))
            options.append(extra)
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
    return params, options if len(groups) > 1 or any(options) else None


def overrides(op: str, kind: str, base_lr: float, options: dict) -> dict:
    """A group's options as per-slot overrides of leantrain's fields (``lr`` as ``lr_scale``)."""
    out: dict = {}
    for key, value in options.items():
        if key in IGNORED:
            continue
        if key == "lr":
            value = value.item() if isinstance(value, torch.Tensor) else value
            if value != base_lr:
                if base_lr == 0:
                    raise ConfigError(f"{op}: a param group sets lr={value!r} but the optimizer's rate is 0; give "
                                      f"the optimizer a nonzero lr")
                out["lr_scale"] = value / base_lr
        elif key in PAIRS:
            if not (isinstance(value, (tuple, list)) and len(value) == 2):
                raise ConfigError(f"{op}: param group option {key} must be a pair, got {value!r}")
            out.update(zip(PAIRS[key], value))
        else:
            out[RENAMES.get(kind, {}).get(key, key)] = value
    return out


def group_function(op: str, kind: str, base_lr: float, params: ParamList, options: list) -> Callable:
    """A per-slot function (``Optimizer.per_slot``) giving each slot its group's overrides."""
    by_tensor = {view_key(params[i].storage.host): overrides(op, kind, base_lr, o) for i, o in enumerate(options)}
    return lambda p: by_tensor.get(view_key(p.storage.host), {})

