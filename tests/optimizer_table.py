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

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from leantrain import optim
from leantrain.optim.rules import record_type, rule_for


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
}

NAMES = list(TABLE)
NATIVE = [name for name, case in TABLE.items() if case.opt.native]
REFERENCED = [name for name, case in TABLE.items() if case.has_reference]
