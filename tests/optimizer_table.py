"""The one table of optimizer cases every contract test reads (the library's own table,
``optim.OPTIMIZERS`` and ``rules.RULES``, with a setting per case and an independent
float64 formula).

A case's torch counterpart is the rule's declared ``torch_equivalent`` (with
``fused=True`` where leantrain runs that kernel); for a rule torch.optim lacks (Lion)
it is ``HandLion`` below, a ``torch.optim.Optimizer`` written here from the paper in the
same operation order, so the differential tests cover it too. Adding an optimizer to
the library without a case here fails ``test_the_table_covers_every_optimizer``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from leantrain import optim
from leantrain.optim.rules import elementwise, record_type, rule_for


class HandLion(torch.optim.Optimizer):
    """Lion as a plain-PyTorch user would write it (Chen et al. 2023, Algorithm 2)."""

    def __init__(self, params, lr: float, betas=(0.9, 0.99), weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                if group["weight_decay"] != 0.0:
                    p.mul_(1.0 - group["lr"] * group["weight_decay"])
                p.add_(torch.lerp(m, p.grad, 1.0 - b1).sign_(), alpha=-group["lr"])
                m.lerp_(p.grad, 1.0 - b2)


@dataclass(frozen=True)
class Case:
    """One optimizer setting (valid in every float dtype: no beta rounds to 1 in bfloat16):
    ``make(numerics)`` builds it; ``f64(h, p, grads)`` is its
    formula written out in float64 (never the library's code); ``faster``: a setting
    that converges on a quadratic in 300 steps, when ``make``'s does not."""

    make: Callable[..., optim.Optimizer]
    f64: Callable
    faster: Optional[Callable[[], optim.Optimizer]] = None
    hyper: dict = field(default_factory=dict)  # the settings, by name, for hand-written formulas
    # how close the float64 run comes to ``f64``: NAdam's momentum product and ASGD's eta
    # are binary32 scalars in torch's implementation, whatever the parameters' dtype
    f64_rtol: float = 1e-12

    @property
    def opt(self) -> optim.Optimizer:
        return self.make()

    @property
    def kind(self) -> str:
        return self.make().kind

    def torch(self) -> tuple[type, dict]:
        """The torch.optim class and arguments doing the same update."""
        h = self.make().hyper
        found = rule_for(h).torch_equivalent(h)
        if found is not None:
            return found
        assert isinstance(h, optim.Lion), h
        return HandLion, dict(lr=h.lr, betas=(h.beta1, h.beta2), weight_decay=h.weight_decay)

    @property
    def stateful(self) -> bool:
        """Whether the rule keeps per-tensor state (momentum, moments), which a skipped,
        clipped or resumed update must carry exactly."""
        return bool(getattr(record_type(self.make().hyper), "__dataclass_fields__", {}))

    @property
    def sparse(self) -> bool:
        """Whether the rule takes sparse gradients (as its torch.optim counterpart does)."""
        return bool(getattr(rule_for(self.make().hyper), "sparse", False))

    @property
    def elementwise(self) -> bool:
        """Whether sharding may cut its state (every rule but Muon's)."""
        return elementwise(self.make().hyper)

    @property
    def has_reference(self) -> bool:
        """Whether ``numerics="torchlean"`` exists for it (upstream has the rule)."""
        return rule_for(self.make().hyper).reference is not None


def _sgd(h, p, grads):
    for g in grads:
        p = p - g * h.lr
    return p


def _momentum(h, p, grads):
    b = torch.zeros_like(p)
    for g in grads:
        b = b * h.momentum + g
        p = p - b * h.lr
    return p


def _adagrad(h, p, grads):
    a = torch.zeros_like(p)
    for g in grads:
        a = a + g * g
        p = p - (h.lr / (torch.sqrt(a) + h.eps)) * g
    return p


def _rmsprop(h, p, grads):
    a = torch.zeros_like(p)
    for g in grads:
        a = a * h.decay + g * g * (1 - h.decay)
        p = p - (h.lr / (torch.sqrt(a) + h.eps)) * g
    return p


def _adam(h, p, grads):
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    b1p = b2p = 1.0
    for g in grads:
        if isinstance(h, optim.AdamW):
            p = p - p * (h.lr * h.weight_decay)
        b1p, b2p = b1p * h.beta1, b2p * h.beta2
        m = m * h.beta1 + g * (1 - h.beta1)
        v = v * h.beta2 + g * g * (1 - h.beta2)
        mhat, vhat = m * (1 / (1 - b1p)), v * (1 / (1 - b2p))
        p = p - (h.lr / (torch.sqrt(vhat) + h.eps)) * mhat
    return p


def _adadelta(h, p, grads):
    a, b = torch.zeros_like(p), torch.zeros_like(p)
    for g in grads:
        a = a * h.rho + g * g * (1 - h.rho)
        dx = (torch.sqrt(b + h.eps) / torch.sqrt(a + h.eps)) * g
        p = p - dx * h.lr
        b = b * h.rho + dx * dx * (1 - h.rho)
    return p


def _lion(h, p, grads):
    m = torch.zeros_like(p)
    for g in grads:
        p = p * (1 - h.lr * h.weight_decay)
        p = p - h.lr * torch.sign(h.beta1 * m + (1 - h.beta1) * g)
        m = h.beta2 * m + (1 - h.beta2) * g
    return p


def _nadam(h, p, grads):
    m, v, prod = torch.zeros_like(p), torch.zeros_like(p), 1.0
    for t, g in enumerate(grads, 1):
        g = g + h.weight_decay * p
        mu = h.beta1 * (1 - 0.5 * 0.96 ** (t * h.momentum_decay))
        mu_next = h.beta1 * (1 - 0.5 * 0.96 ** ((t + 1) * h.momentum_decay))
        prod *= mu
        m = h.beta1 * m + (1 - h.beta1) * g
        v = h.beta2 * v + (1 - h.beta2) * g * g
        denom = torch.sqrt(v / (1 - h.beta2 ** t)) + h.eps
        p = p - h.lr * (1 - mu) / (1 - prod) * g / denom - h.lr * mu_next / (1 - prod * mu_next) * m / denom
    return p


def _radam(h, p, grads):
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    rho_inf = 2 / (1 - h.beta2) - 1
    for t, g in enumerate(grads, 1):
        m = h.beta1 * m + (1 - h.beta1) * g
        v = h.beta2 * v + (1 - h.beta2) * g * g
        mhat = m / (1 - h.beta1 ** t)
        rho = rho_inf - 2 * t * h.beta2 ** t / (1 - h.beta2 ** t)
        if rho > 5:
            rect = math.sqrt((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho))
            p = p - h.lr * mhat * rect * math.sqrt(1 - h.beta2 ** t) / (torch.sqrt(v) + h.eps)
        else:
            p = p - h.lr * mhat
    return p


def _adamax(h, p, grads):
    m, u = torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, 1):
        m = h.beta1 * m + (1 - h.beta1) * g
        u = torch.maximum(h.beta2 * u, g.abs() + h.eps)
        p = p - h.lr / (1 - h.beta1 ** t) * m / u
    return p


def _asgd(h, p, grads):
    eta = h.lr
    for t, g in enumerate(grads, 1):
        p = p * (1 - h.lambd * eta) - eta * g
        eta = h.lr / (1 + h.lambd * h.lr * t) ** h.alpha
    return p


def _rprop(h, p, grads):
    prev, size = torch.zeros_like(p), torch.full_like(p, h.lr)
    for g in grads:
        s = torch.sign(g * prev)
        factor = torch.ones_like(p)
        factor[s > 0], factor[s < 0] = h.etaplus, h.etaminus
        size = torch.clamp(size * factor, h.step_size_min, h.step_size_max)
        g = torch.where(s < 0, 0.0, g)
        p = p - torch.sign(g) * size
        prev = g
    return p


TABLE: dict[str, Case] = {
    "sgd": Case(lambda numerics="fast": optim.sgd(0.1, numerics=numerics), _sgd),
    "momentum": Case(lambda numerics="fast": optim.sgd(0.05, 0.9, numerics=numerics), _momentum,
                     hyper={"momentum": 0.9}),
    "adagrad": Case(lambda numerics="fast": optim.adagrad(0.1, 1e-10, numerics=numerics), _adagrad,
                    faster=lambda: optim.adagrad(1.0), hyper={"eps": 1e-10}),
    "rmsprop": Case(lambda numerics="fast": optim.rmsprop(0.01, 0.9, 1e-8, numerics=numerics), _rmsprop,
                    faster=lambda: optim.rmsprop(0.05), hyper={"decay": 0.9, "eps": 1e-8}),
    "adam": Case(lambda numerics="fast": optim.adam(0.01, 0.9, 0.99, 1e-8, numerics=numerics), _adam,
                 faster=lambda: optim.adam(0.1), hyper={"beta1": 0.9, "beta2": 0.99, "eps": 1e-8}),
    "adamw": Case(lambda numerics="fast": optim.adamw(0.01, 0.05, 0.9, 0.99, 1e-8, numerics=numerics), _adam,
                  faster=lambda: optim.adamw(0.1, 0.01),
                  hyper={"beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.05}),
    "adadelta": Case(lambda numerics="fast": optim.adadelta(1.0, 0.9, 1e-6, numerics=numerics), _adadelta,
                     faster=lambda: optim.adadelta(10.0), hyper={"rho": 0.9, "eps": 1e-6}),
    "lion": Case(lambda numerics="fast": optim.lion(0.003, 0.9, 0.99, 0.1, numerics=numerics), _lion,
                 faster=lambda: optim.lion(0.02, 0.9, 0.9), hyper={"beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1}),
    "nadam": Case(lambda numerics="fast": optim.nadam(0.01, (0.9, 0.99), numerics=numerics), _nadam,
                  faster=lambda: optim.nadam(0.1), f64_rtol=1e-6),
    "radam": Case(lambda numerics="fast": optim.radam(0.01, (0.9, 0.99), numerics=numerics), _radam,
                  faster=lambda: optim.radam(0.1)),
    "adamax": Case(lambda numerics="fast": optim.adamax(0.01, (0.9, 0.99), numerics=numerics), _adamax,
                   faster=lambda: optim.adamax(0.1)),
    "asgd": Case(lambda numerics="fast": optim.asgd(0.05, lambd=1e-3, numerics=numerics), _asgd, f64_rtol=1e-6),
    "rprop": Case(lambda numerics="fast": optim.rprop(0.01, numerics=numerics), _rprop),
    # Adafactor's eps1 defaults to the dtype's epsilon, so a float64 formula is no
    # reference for float32; torch.optim.Adafactor is, bit for bit (test_optim_db.py)
    "adafactor": Case(lambda numerics="fast": optim.adafactor(0.05, numerics=numerics), None,
                      faster=lambda: optim.adafactor(0.5, d=2.0)),
    # Muon orthogonalises in bfloat16 by design: no float64 reference to compare to.
    "muon": Case(lambda numerics="fast": optim.muon(0.02, weight_decay=0.01, adamw_betas=(0.9, 0.99),
                                                     numerics=numerics), None, faster=lambda: optim.muon(0.1, 0.0)),
}

NAMES = list(TABLE)
SHARDABLE = [name for name, case in TABLE.items() if case.elementwise]
NATIVE = [name for name, case in TABLE.items() if case.opt.native]
REFERENCED = [name for name, case in TABLE.items() if case.has_reference]
