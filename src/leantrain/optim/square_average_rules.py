"""The rules that keep running averages of squared gradients and run torch's foreach
forms: RMSprop and Adadelta (upstream has both; their torch options run torch's own
functional forms, the bits of ``torch.optim.RMSprop(foreach=True)`` and
``torch.optim.Adadelta(foreach=True)``).

* RMSProp:   ``A = A*decay + (1-decay)*g*g``; ``p += -lr * g / (sqrt(A) + eps)``
* Adadelta:  ``E = E*rho + (1-rho)*g*g``; ``d = sqrt(D+eps)/sqrt(E+eps)*g``;
  ``D = D*rho + (1-rho)*d*d``; ``p += -lr * d``
"""

from __future__ import annotations

import torch

from .hyper import Adadelta, RMSProp
from .kernels import foreach, has_options, step_tensors, torch_flags, torch_options
from .records import (
    AdadeltaState, RMSPropCenteredMomentumState, RMSPropCenteredState, RMSPropMomentumState, RMSPropState,
)
from .reference import FORMULAS as upstream


_RMSPROP_RECORDS = {(False, False): RMSPropState, (False, True): RMSPropMomentumState,
                    (True, False): RMSPropCenteredState, (True, True): RMSPropCenteredMomentumState}


class RMSPropRule:
    sparse = False
    hypers = (RMSProp,)
    records = tuple(_RMSPROP_RECORDS.values())
    reference = staticmethod(upstream.rmsprop)

    @staticmethod
    def record_type(h: RMSProp) -> type:
        return _RMSPROP_RECORDS[(h.centered, h.momentum != 0.0)]

    @staticmethod
    def torch_equivalent(h: RMSProp):
        return torch.optim.RMSprop, dict(lr=h.lr, alpha=h.decay, eps=h.eps, **torch_flags(h), **torch_options(h))

    @staticmethod
    def native(h) -> bool:
        return False

    @staticmethod
    def init(h: RMSProp, p):
        kind = RMSPropRule.record_type(h)
        return kind(**{name: torch.zeros_like(p, memory_format=torch.preserve_format) for name in kind.TENSORS}) \
            if kind is not RMSPropState else RMSPropState(torch.zeros_like(p))

    @staticmethod
    def update_many(h: RMSProp, lr, ss, ps, gs, uniform: bool = False):
        avgs = [s.avg for s in ss]
        if has_options(h) or h.implementation == "for-loop":  # torch.optim.RMSprop's own form
            import torch.optim.rmsprop as F
            F.rmsprop(list(ps), list(gs), avgs, [s.grad_avg for s in ss] if h.centered else [],
                      [s.buf for s in ss] if h.momentum != 0.0 else [], step_tensors(ss),
                      foreach=foreach(h),
                      maximize=h.maximize, lr=lr, alpha=h.decay, eps=h.eps, weight_decay=h.weight_decay,
                      momentum=h.momentum, centered=h.centered)
            return ss
        torch._foreach_mul_(avgs, h.decay)
        torch._foreach_addcmul_(avgs, gs, gs, value=1.0 - h.decay)
        denom = torch._foreach_sqrt(avgs)
        torch._foreach_add_(denom, h.eps)
        torch._foreach_addcdiv_(ps, gs, denom, value=-lr)
        return ss


class AdadeltaRule:
    sparse = False
    hypers = (Adadelta,)
    records = (AdadeltaState,)
    reference = staticmethod(upstream.adadelta)

    @staticmethod
    def torch_equivalent(h: Adadelta):
        return torch.optim.Adadelta, dict(lr=h.lr, rho=h.rho, eps=h.eps, **torch_flags(h), **torch_options(h))

    @staticmethod
    def native(h) -> bool:
        return False

    @staticmethod
    def init(h: Adadelta, p):
        return AdadeltaState(torch.zeros_like(p), torch.zeros_like(p))

    @staticmethod
    def update_many(h: Adadelta, lr, ss, ps, gs, uniform: bool = False):
        sq, da = [s.square_avg for s in ss], [s.delta_avg for s in ss]
        if has_options(h) or h.implementation == "for-loop":  # torch.optim.Adadelta's own form
            import torch.optim.adadelta as F
            F.adadelta(list(ps), list(gs), sq, da, step_tensors(ss), foreach=foreach(h), lr=lr,
                       rho=h.rho, eps=h.eps,
                       weight_decay=h.weight_decay, maximize=h.maximize)
            return ss
        torch._foreach_mul_(sq, h.rho)
        torch._foreach_addcmul_(sq, gs, gs, value=1.0 - h.rho)
        std = torch._foreach_add(sq, h.eps)
        torch._foreach_sqrt_(std)
        delta = torch._foreach_add(da, h.eps)
        torch._foreach_sqrt_(delta)
        torch._foreach_div_(delta, std)
        torch._foreach_mul_(delta, gs)
        torch._foreach_mul_(da, h.rho)
        torch._foreach_addcmul_(da, delta, delta, value=1.0 - h.rho)
        torch._foreach_add_(ps, delta, alpha=-lr)
        return ss
