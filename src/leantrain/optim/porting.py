"""``from_torch``: a ``torch.optim`` optimizer (its class, groups and hyperparameters) as
leantrain's, with the history its state holds, so a run started in plain PyTorch
continues here exactly."""

from __future__ import annotations

from dataclasses import replace

import torch

from ..errors import ConfigError
from ..params.module_slots import view_key
from .constructors import CONSTRUCTORS, TORCH_NAMES
from .layout import GENERIC
from .optimizer import OptState, Optimizer
from .rules import record_type, rule_for
from .torch_style import as_param_list, group_function, group_rates


# record field -> torch.optim's state key
STATE_KEYS = {"m": "exp_avg", "v": "exp_avg_sq", "vmax": "max_exp_avg_sq", "buf": "momentum_buffer", "sum": "sum",
              "avg": "square_avg", "grad_avg": "grad_avg", "square_avg": "square_avg", "delta_avg": "acc_delta",
              "u": "exp_inf", "ax": "ax", "prev": "prev", "step_size": "step_size", "row_var": "row_var",
              "col_var": "col_var", "variance": "variance"}


def from_torch(torch_optimizer: torch.optim.Optimizer, target=None):
    """A torch scheduler (``torch.optim.lr_scheduler``'s classes, ``swa_utils.SWALR``):
    leantrain's schedule of the same class, at the step it stands (``optim/schedules/lr_scheduler/porting.py``).

    A torch optimizer: ``(optimizer, state)``: leantrain's optimizer (running the
    implementation torch runs for those tensors and flags: ``fused=True``, foreach, or the
    per-tensor loop torch takes on CPU when neither is given) for a ``torch.optim`` optimizer (its
    class, its first group's hyperparameters as the base, every other group's differences
    as per-slot settings) and the history its state holds, for ``target`` (the module,
    Runner or ParamList training continues on; by default the groups' own tensors). A
    run started in plain PyTorch continues here with the bits it would have had there."""
    op = "optim.from_torch"
    if isinstance(torch_optimizer, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        from .schedules.lr_scheduler.porting import port_scheduler

        if target is not None:
            raise ConfigError(f"{op}: a scheduler ports alone (its optimizer's groups give its rates); drop target")
        return port_scheduler(torch_optimizer, op)
    if not isinstance(torch_optimizer, torch.optim.Optimizer):
        raise ConfigError(f"{op}: expected a torch.optim optimizer, got {type(torch_optimizer).__name__}")
    name = type(torch_optimizer).__name__
    if name not in TORCH_NAMES:
        raise ConfigError(f"{op}: leantrain has no counterpart of torch.optim.{name}; it ports "
                          f"{', '.join(sorted(TORCH_NAMES))}")
    kind = TORCH_NAMES[name]
    groups = torch_optimizer.param_groups
    options = [{k: v for k, v in g.items() if k not in ("params", "param_names", "initial_lr")} for g in groups]
    for o in options:  # the implementation torch would run for these tensors, by name
        if "foreach" in o and o["foreach"] is None and not o.get("fused"):
            o["foreach"] = _torch_default_foreach([p for g in groups for p in g["params"]])
    base = CONSTRUCTORS[kind](**options[0])
    tensors = {id(p): p for g in groups for p in g["params"]}
    if target is None:
        target = [{"params": list(g["params"])} for g in groups]
    params, _ = as_param_list(op, target)
    group_of = {view_key(p): k for k, g in enumerate(groups) for p in g["params"]}
    per_slot = []  # (group, the options of its group that differ from the first group's)
    for i in range(len(params)):
        k = group_of.get(view_key(params[i].storage.host), 0)
        per_slot.append((k, {key: v for key, v in options[k].items() if key == "lr" or options[0].get(key) != v}))
    opt = base
    if len(groups) > 1:  # each group its own settings and rate, exactly
        fn, of, each = group_function(op, kind, params, per_slot)
        opt = Optimizer(base.hyper, fn, group_lrs=group_rates(op, base.hyper.lr, per_slot), group_of=of,
                        group_options=each)
    settings, asked = opt.settings(op, params)
    state_of = {view_key(p): torch_optimizer.state.get(p, {}) for p in tensors.values()}
    slots_map = params.canonical_slot_indices()
    records: list = [None] * len(params)
    steps = 0
    for i, c in enumerate(slots_map):
        if c != i:
            records[i] = None if c is None else records[c]
            continue
        h = opt.hyper if settings is None else settings[i][0]
        host = params[i].storage.host
        if view_key(host) not in state_of:
            raise ConfigError(f"{op}: {params.label(i)} of the target is not a parameter of the torch optimizer; "
                              f"give the module (or tensors) the torch optimizer updates, so each slot takes "
                              f"its own history")
        saved = state_of.get(view_key(host), {})
        fresh = rule_for(h).init(h, host)
        if not saved:
            records[i] = fresh
            continue
        records[i] = _record(op, params.label(i), record_type(h, tuple(host.shape)), h, fresh, saved)
        steps = max(steps, int(getattr(records[i], "step", 0)))
    return opt, OptState(opt.hyper, opt.hyper.lr, GENERIC, tuple(records), steps, asked, lrs=opt.group_lrs,
                         bases=opt.group_lrs)


def _torch_default_foreach(params) -> bool:
    """torch.optim's own choice with neither ``foreach`` nor ``fused`` given: foreach where
    every tensor is on a foreach device (CUDA...), the per-tensor loop otherwise (CPU)."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    return _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)[1]


def _record(op: str, where: str, kind: type, h, fresh, saved: dict):
    """One slot's record from torch's state for it (tensors copied, scalars read)."""
    values = {}
    for field, t in fresh.tensors().items():
        theirs = saved.get(STATE_KEYS[field])
        if theirs is None:  # e.g. SGD's momentum buffer before its first step
            values[field] = t
        elif tuple(theirs.shape) != tuple(t.shape):
            raise ConfigError(f"{op}: {where}: torch's {STATE_KEYS[field]} has shape {tuple(theirs.shape)}, the "
                              f"parameter {tuple(t.shape)}")
        else:
            values[field] = theirs.detach().to(t.dtype).clone()
    step = saved.get("step")
    t = int(step.item() if isinstance(step, torch.Tensor) else (step or 0))  # the host counter torch keeps
    if step is None and values:  # torch's SGD counts no steps: a buffer means it has started
        t = 1
    scalars = {"step": t} if "step" in kind.__dataclass_fields__ else {}
    for name in ("mu_product", "eta", "mu"):
        if name in kind.__dataclass_fields__ and name in saved:
            scalars[name] = float(saved[name].item())  # a one-element state tensor, read once at porting
    if "beta1_power" in kind.__dataclass_fields__:  # the products the records keep, as they would have
        b1p = b2p = 1.0
        for _ in range(t):
            b1p, b2p = b1p * h.beta1, b2p * h.beta2
        scalars.update(beta1_power=b1p, beta2_power=b2p)
    return replace(fresh, **values, **scalars)
