"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), a rule
torch.optim does not have: the sign of an interpolation of the momentum and the
gradient, with decoupled weight decay. Per tensor, in this order::

    p *= 1 - lr*wd                 (skipped when wd == 0: the product is p itself)
    c  = lerp(m, g, 1 - b1)        (b1*m + (1-b1)*g)
    p += -lr * sign(c)
    m  = lerp(m, g, 1 - b2)

Every operation is elementwise, so one tensor alone gets the bits it gets in a group;
there is no fused kernel and no fallback. Tested against a float64 reference.
"""

from __future__ import annotations

import torch

from .hyper import Lion
from .records import LionState


class LionRule:
    """Lion: no fused kernel, one foreach form on every device (the same bits per tensor
    alone or in a group: every operation is elementwise)."""

    hypers = (Lion,)
    records = (LionState,)
    sparse = False
    reference = None  # upstream has no Lion: numerics="torchlean" is refused

    @staticmethod
    def torch_equivalent(h: Lion):
        return None  # torch.optim has no Lion

    @staticmethod
    def native(h: Lion) -> bool:
        return True  # elementwise, no host read: its state lives beside the mirrors

    @staticmethod
    def init(h: Lion, p):
        return LionState(torch.zeros_like(p))

    @staticmethod
    def update_many(h: Lion, lr, ss, ps, gs, uniform: bool = False):
        ms = [s.m for s in ss]
        if h.weight_decay != 0.0:
            torch._foreach_mul_(ps, 1.0 - lr * h.weight_decay)
        c = torch._foreach_lerp(ms, gs, 1.0 - h.beta1)  # the one temporary per tensor
        torch._foreach_sign_(c)
        torch._foreach_add_(ps, c, alpha=-lr)
        torch._foreach_lerp_(ms, gs, 1.0 - h.beta2)
        return ss
