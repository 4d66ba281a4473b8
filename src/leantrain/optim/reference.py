"""Upstream's per-tensor update formulas, in upstream's operation order
(``numerics="torchlean"``, spec §3 and §4).

Every written operation is one rounding, in the parameter's own dtype: the
hyperparameters are first cast to it (upstream's ``ofFloat``), and scalar arithmetic
such as ``1 - decay``, ``lr * wd`` or Adam's powers ``b^t`` (repeated left
multiplication from 1) happens in that dtype too. A quotient ``lr / d`` is a true
division. So SGD writes ``p - g*lr`` as two roundings: ``2.0 - 1.3*0.1`` is ``1.87``
in binary64, where the fast path's fused ``p + (-lr)*g`` gives ``1.8699999999999999``.

This is slower than the fast path (a temporary per operation, host only) and exists to
replay a run and compare it with TorchLean bit for bit. Each rule names its formula here
(``rules.*Rule.reference``); a rule upstream does not have (Lion) names none, and its
constructor refuses ``numerics="torchlean"``.

* SGD:      ``p - g*lr``
* momentum: ``b = b*mu + g``; ``p - b*lr``
* AdaGrad:  ``G = G + g*g``; ``p - (lr/(sqrt(max(G,0))+eps))*g``
* RMSProp:  ``A = A*decay + (g*g)*(1-decay)``; ``p - (lr/(sqrt(max(A,0))+eps))*g``
* Adam:     ``m = m*b1 + g*(1-b1)``; ``v = v*b2 + (g*g)*(1-b2)``;
  ``mhat = m*(1/(1-b1^t))``; ``vhat = v*(1/(1-b2^t))``; ``p - (lr/(sqrt(max(vhat,0))+eps))*mhat``
* AdamW:    the Adam moments; ``pd = p - p*(lr*wd)``; ``pd - (lr/(sqrt(vhat)+eps))*mhat``
* Adadelta: ``E = E*rho + (g*g)*(1-rho)``; ``rms(x) = sqrt(max(x+eps,0))``;
  ``dx = (rms(D)/rms(E))*g``; ``p - dx*lr``; ``D = D*rho + (dx*dx)*(1-rho)``
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from .hyper import SGD, Adadelta, Adagrad, AdamW, RMSProp
from .records import AdadeltaState, AdagradState, AdamState, RMSPropState


def _scalar(x, like: torch.Tensor) -> torch.Tensor:
    """``x`` cast to ``like``'s dtype (upstream's ``ofFloat``), as a 0-dim tensor."""
    return torch.tensor(x, dtype=like.dtype, device=like.device)


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root. PyTorch's vectorised CPU kernel (Sleef, 0.5 ulp
    bound) can miss by one ulp; numpy's uses the hardware instruction. CUDA's is exact."""
    if x.device.type != "cpu":
        return torch.sqrt(x)
    return torch.from_numpy(np.sqrt(x.detach().numpy()))


def _rms(x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    return _sqrt(torch.clamp_min(x + eps, 0))


def sgd(h: SGD, lr: float, s, p: torch.Tensor, g: torch.Tensor):
    """SGD ``p - g*lr``; momentum ``b = b*mu + g``, ``p - b*lr``."""
    S = lambda x: _scalar(x, p)  # noqa: E731
    if h.momentum == 0.0:
        p.copy_(p - g * S(lr))
        return s
    buf = s.buf * S(h.momentum) + g
    s.buf.copy_(buf)
    p.copy_(p - buf * S(lr))
    return s


def adagrad(h: Adagrad, lr: float, s: AdagradState, p: torch.Tensor, g: torch.Tensor) -> AdagradState:
    S = lambda x: _scalar(x, p)  # noqa: E731
    G = s.sum + g * g
    s.sum.copy_(G)
    p.copy_(p - torch.div(S(lr), _sqrt(torch.clamp_min(G, 0)) + S(h.eps)) * g)
    return AdagradState(s.sum)


def rmsprop(h: RMSProp, lr: float, s: RMSPropState, p: torch.Tensor, g: torch.Tensor) -> RMSPropState:
    S = lambda x: _scalar(x, p)  # noqa: E731
    A = s.avg * S(h.decay) + (g * g) * (S(1.0) - S(h.decay))
    s.avg.copy_(A)
    p.copy_(p - torch.div(S(lr), _sqrt(torch.clamp_min(A, 0)) + S(h.eps)) * g)
    return RMSPropState(s.avg)


def adam(h, lr: float, s: AdamState, p: torch.Tensor, g: torch.Tensor) -> AdamState:
    """Adam and AdamW (``isinstance(h, AdamW)``: decoupled decay before the step)."""
    S = lambda x: _scalar(x, p)  # noqa: E731
    one, b1, b2 = S(1.0), S(h.beta1), S(h.beta2)
    b1p = S(s.beta1_power) * b1  # the cached power is held exactly (a value of this dtype)
    b2p = S(s.beta2_power) * b2
    m = s.m * b1 + g * (one - b1)
    v = s.v * b2 + (g * g) * (one - b2)
    s.m.copy_(m)
    s.v.copy_(v)
    mhat = m * torch.div(one, one - b1p)
    vhat = v * torch.div(one, one - b2p)
    if isinstance(h, AdamW):
        pd = p - p * (S(lr) * S(h.weight_decay))
        p.copy_(pd - torch.div(S(lr), _sqrt(vhat) + S(h.eps)) * mhat)
    else:
        p.copy_(p - torch.div(S(lr), _sqrt(torch.clamp_min(vhat, 0)) + S(h.eps)) * mhat)
    return AdamState(s.step + 1, s.m, s.v, float(b1p), float(b2p))


def adadelta(h: Adadelta, lr: float, s: AdadeltaState, p: torch.Tensor, g: torch.Tensor) -> AdadeltaState:
    S = lambda x: _scalar(x, p)  # noqa: E731
    one, rho, eps = S(1.0), S(h.rho), S(h.eps)
    E = s.square_avg * rho + (g * g) * (one - rho)
    dx = torch.div(_rms(s.delta_avg, eps), _rms(E, eps)) * g
    s.square_avg.copy_(E)
    p.copy_(p - dx * S(lr))
    s.delta_avg.copy_(s.delta_avg * rho + (dx * dx) * (one - rho))
    return AdadeltaState(s.square_avg, s.delta_avg)


# The formulas by rule, for the rules' ``reference`` declarations (rules.py).
FORMULAS = SimpleNamespace(sgd=sgd, adagrad=adagrad, rmsprop=rmsprop, adam=adam, adadelta=adadelta)
