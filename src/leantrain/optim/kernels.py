"""What the rules share: torch's step counters as host tensors, the torch options a
record sets, and Adam/AdamW through torch's fused kernel (also Muon's fallback)."""

from __future__ import annotations

import torch

from .fused import adam as fused_adam_kernel
from .hyper import AdamW
from .records import AdamState, AMSGradState


def has_options(h) -> bool:
    """Whether ``h`` sets a torch option beyond upstream's formula."""
    return any(getattr(h, n) != type(h).__dataclass_fields__[n].default for n in h._torch_only)


def torch_options(h) -> dict:
    """The torch options ``h`` sets off their defaults, by torch's names."""
    return {n: getattr(h, n) for n in h._torch_only if getattr(h, n) != type(h).__dataclass_fields__[n].default}


def scalar_dtype() -> torch.dtype:
    """The dtype torch.optim keeps its step counters in (float32; float64 when that is the default)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def host_counter(value: float) -> torch.Tensor:
    """A host scalar tensor holding an optimizer counter, as torch.optim keeps its ``step``
    when it is not capturing CUDA graphs. torch's implementations read it with ``.item()``:
    a read of host memory, never a device sync; ``host_counter`` marks it so (the tests of
    host reads tell these from a read of a device value)."""
    t = torch.tensor(value, dtype=scalar_dtype())
    t.host_counter = True
    return t


def step_tensors(ss: list) -> list:
    """Each record's step as the host scalar tensor torch.optim keeps (0 for records
    that count none: their rules never read it)."""
    return [host_counter(float(getattr(s, "step", 0))) for s in ss]


def fused_adam(h, lr: float, ss: list, ps, gs) -> list:
    """Adam/AdamW by torch's fused kernel (see fused.py); the records advance as always."""
    news = advanced(h, ss)
    fused_adam_kernel(ps, gs, [s.m for s in ss], [s.v for s in ss], [n.step for n in news],
                      adamw=decoupled(h), lr=lr, beta1=h.beta1, beta2=h.beta2,
                      weight_decay=h.weight_decay, eps=h.eps, maximize=h.maximize,
                      vmaxs=[s.vmax for s in ss] if h.amsgrad else None)
    return news


def decoupled(h) -> bool:
    return isinstance(h, AdamW) or h.decoupled_weight_decay


def advanced(h, ss: list) -> list:
    """The records one step on (the same buffers, ``t + 1``)."""
    if h.amsgrad:
        return [AMSGradState(s.step + 1, s.m, s.v, s.vmax) for s in ss]
    return [AdamState(s.step + 1, s.m, s.v, s.beta1_power * h.beta1, s.beta2_power * h.beta2) for s in ss]
