"""Plain PyTorch doing what leantrain's contract says: the references ``check`` measures
against (a deep copy of the user's module, ``autograd`` and ``torch.optim``)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..optim.rules import rule_for
from ..samples import LossSum, add_losses, call_model, loss_target


def torch_settings(h) -> Optional[tuple[type, dict]]:
    """The ``torch.optim`` class and keyword arguments doing what ``h`` describes (the
    rule's own declaration), or ``None`` where torch.optim has no such rule."""
    return rule_for(h).torch_equivalent(h)


def torch_optimizer(opt, module: nn.Module, params) -> Optional[torch.optim.Optimizer]:
    """The ``torch.optim`` optimizer doing what ``opt`` does to ``params`` (a Runner's
    slots) on ``module`` (a deep copy of the Runner's module): one parameter group per
    per-slot setting (``opt.per_slot``), each with its own hyperparameters and rate;
    ``None`` where torch.optim has no such rule (Lion)."""
    found = torch_settings(opt.hyper)
    if found is None:
        return None
    cls, base = found
    by_name = dict(module.named_parameters())
    settings = opt.settings("check", params)[0]
    reps = params.canonical_slot_indices()
    if settings is None:
        return cls([by_name[params[i].name] for i, c in enumerate(reps) if c == i], **base)
    groups: dict[tuple, tuple] = {}
    rates = opt.groups_rates()
    for i, c in enumerate(reps):
        if c == i:
            h, scale, g = settings[i]
            groups.setdefault((id(h), scale, g), (h, rates[g] * scale if opt.group_lrs else h.lr * scale, []))[2] \
                .append(by_name[params[i].name])
    return cls([{"params": ps, **torch_settings(h)[1], "lr": lr} for h, lr, ps in groups.values()], **base)


def _set_buffer(model: nn.Module, name: str, value: torch.Tensor) -> None:
    prefix, _, attr = name.rpartition(".")
    setattr(model.get_submodule(prefix) if prefix else model, attr, value)


def reference_gradients(model: nn.Module, loss_fn, batch) -> None:
    """Set each trainable parameter's ``.grad`` to the contract's mean gradient: every
    item's forward advances the buffers first (no gradient, the generators then put
    back), then one backward of ``(l1 + ... + ln) * (1/n)``, each item seeing the
    advanced buffers."""
    rng = torch.get_rng_state()
    with torch.no_grad():
        for sample in batch:
            call_model(model, sample)
    torch.set_rng_state(rng)
    own = dict(model.named_buffers())
    advanced = {k: b.clone() for k, b in own.items()}
    model.zero_grad(set_to_none=True)
    total = None
    for sample in batch:
        for k, b in advanced.items():
            _set_buffer(model, k, b.clone())
        loss = loss_fn(call_model(model, sample), loss_target(sample))
        total = loss if total is None else add_losses(total, loss)
    if isinstance(total, LossSum):  # token-weighted: the sum of totals over the sum of counts
        (total.total * (1.0 / int(total.count))).backward()
    else:
        (total * (1.0 / len(batch))).backward()
    with torch.no_grad():
        for k, b in own.items():
            b.copy_(advanced[k])
            _set_buffer(model, k, b)


def fingerprint(model: nn.Module) -> dict:
    """What a call must not change about a module: its objects, ties and keys."""
    named = list(model.named_parameters(remove_duplicate=False))
    return {
        "parameter objects": [(n, id(p)) for n, p in named],
        "buffer objects": [(n, id(b)) for n, b in model.named_buffers(remove_duplicate=False)],
        "state_dict keys": list(model.state_dict().keys()),
        "ties": sorted((a, b) for i, (a, p) in enumerate(named) for b, q in named[i + 1:] if p is q),
        "requires_grad": [(n, p.requires_grad) for n, p in named],
    }


def relative(a: torch.Tensor, b: torch.Tensor, scale: float = 0.0) -> float:
    """``|a - b| / max(|b|, scale)`` in float64 norms (0 when both are zero)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    denom = max(b.norm().item(), scale)  # intentional reads: a diagnostic
    diff = (a - b).norm().item()
    return diff if denom == 0 else diff / denom
