"""The update rules over typed state records (spec §3), and the one table of them.

Each rule is a class of static functions over one kind's hyperparameters ``h``:

* ``init(h, p)``: the zero state record of one tensor;
* ``update_many(h, lr, records, ps, gs, uniform)``: the update of a group of tensors,
  in place (``uniform``: one device and dtype, as the optimizer's groups are), returning
  the new records. Every form is elementwise: a tensor alone gets the bits it gets in a
  group (tested), so there is no separate per-tensor form;
* ``reference``: upstream's per-tensor formula (``numerics="torchlean"``, in
  ``reference.py``), or ``None`` where upstream has none (the constructor then refuses
  that setting);
* ``torch_equivalent(h)``: the ``torch.optim`` class and arguments that do the same
  update (``None``: no equivalent; ``leantrain check`` says so), with ``fused=True``
  where leantrain runs that fused kernel;
* ``native(h)``: whether it has the device-resident path; ``sparse``: whether it takes
  sparse gradients (``update_sparse``).

The tensors a rule is handed are dense in one layout (``params/dense.py``: the kernels
pair elements by memory position) and every one has a gradient (the shell leaves a slot
without one out). No parameter-sized temporary is allocated except where a formula
needs one (a denominator, Lion's interpolation).

What runs. On CPU and CUDA float tensors SGD (with or without momentum), Adagrad, Adam
and AdamW run torch's fused kernels (``fused.py``), the bits of ``torch.optim.*(fused=
True)``:

* SGD:       ``p += -lr * g``; momentum ``b = b*mu + g``, ``p += -lr * b``
* Adagrad:   ``G += g*g``; ``p -= lr * g / (sqrt(G) + eps)``
* Adam:      ``m = lerp(m, g, 1-b1)``; ``v = v*b2 + (1-b2)*g*g``; ``p -= (lr/c1) * m /
  (sqrt(v)/sqrt(c2) + eps)`` with ``c = 1 - b^t`` in binary64; AdamW first ``p *= 1 - lr*wd``

On other devices and dtypes these four fall back to ``torch._foreach_*`` forms of the
same formulas (Adam's folded as ``p += -(lr*sqrt(c2)/c1) * m / (sqrt(v) + eps*sqrt(c2))``);
the fallbacks are tested against the fused kernels on CPU by forcing them. The other
rules have one form, on every device:

* RMSProp:   ``A = A*decay + (1-decay)*g*g``; ``p += -lr * g / (sqrt(A) + eps)``
* Adadelta:  ``E = E*rho + (1-rho)*g*g``; ``d = sqrt(D+eps)/sqrt(E+eps)*g``;
  ``D = D*rho + (1-rho)*d*d``; ``p += -lr * d``
* Lion:      ``p *= 1 - lr*wd``; ``c = lerp(m, g, 1-b1)``; ``p += -lr * sign(c)``;
  ``m = lerp(m, g, 1-b2)``
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

import torch.optim

from .reference import FORMULAS as upstream
from .fused import adam as fused_adam_kernel, by_device_dtype, fusable
from .hyper import Adadelta, Adagrad, Adam, AdamW, Hyper, RMSProp, SGD
from .lion_rule import LionRule
from .records import (  # noqa: F401  (re-exported: the rules' records live there)
    AdadeltaState, AdagradState, AdamState, LionState, MomentumState, RMSPropState, SGDState, clone_record,
    record_scalars, tensor_fields,
)

Tensors = Sequence[torch.Tensor]


def scalar_problems(record_type: str, values: dict) -> list[str]:
    """Why saved scalar fields ``values`` cannot fill a ``record_type`` record: a missing
    or extra field, a wrong type, a value out of its range."""
    spec = getattr(RECORDS[record_type], "SCALARS", {})
    out = [f"unexpected field {k!r}" for k in sorted(set(values) - set(spec))]
    for name, (kind, low, high) in spec.items():
        v = values.get(name)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or isinstance(v, int))
        if not (ok and math.isfinite(v) and low <= v <= high):
            out.append(f"{name}: expected {'an integer' if kind is int else 'a number'} in [{low}, {high}], got {v!r}")
    return out


# ------------------------------------------------------------------------- rules
class SGDRule:
    hypers = (SGD,)
    records = (SGDState, MomentumState)
    sparse = True  # takes sparse gradients (update_sparse), as torch.optim.SGD does

    @staticmethod
    def record_type(h: SGD) -> type:
        return SGDState if h.momentum == 0.0 else MomentumState
    reference = staticmethod(upstream.sgd)

    @staticmethod
    def torch_equivalent(h: SGD):
        return torch.optim.SGD, dict(lr=h.lr, momentum=h.momentum, fused=True)

    @staticmethod
    def native(h: SGD) -> bool:
        return h.momentum == 0.0  # plain SGD only: momentum has no device path

    @staticmethod
    def init(h: SGD, p: torch.Tensor):
        if h.momentum == 0.0:
            return SGDState()
        return MomentumState(torch.zeros_like(p, memory_format=torch.preserve_format))

    @staticmethod
    def update_many(h: SGD, lr: float, ss: list, ps: Tensors, gs: Tensors, uniform: bool = False) -> list:
        if fusable(ps[:1] if uniform else ps):
            # torch.optim.SGD(fused=True)'s kernel, in one pass (its rounding may differ from
            # the foreach passes below in the last bit; the fallback for other devices).
            bufs = [] if h.momentum == 0.0 else [s.buf for s in ss]
            for group in ([(ps, gs, bufs)] if uniform else by_device_dtype(ps, gs, bufs)):
                torch._fused_sgd_(*group, weight_decay=0.0, momentum=h.momentum, lr=lr, dampening=0.0,
                                  nesterov=False, maximize=False, is_first_step=False)
            return ss
        if h.momentum == 0.0:
            torch._foreach_add_(ps, gs, alpha=-lr)
            return ss
        bufs = [s.buf for s in ss]
        torch._foreach_mul_(bufs, h.momentum)
        torch._foreach_add_(bufs, gs)
        torch._foreach_add_(ps, bufs, alpha=-lr)
        return ss

    @staticmethod
    def update_sparse(h: SGD, lr: float, s, p: torch.Tensor, g: torch.Tensor):
        """The per-tensor form, for a sparse gradient (``nn.Embedding(sparse=True)``) as for
        a dense one off the fused kernels' devices: torch.optim.SGD's ``p += -lr * g`` (a
        sparse ``g`` adds each stored value where it belongs). With momentum
        the buffer is dense (made at init), ``b = b*mu + g``; torch's starts as a sparse
        copy of the first gradient, so repeated rows may round differently there."""
        if h.momentum == 0.0:
            p.add_(g, alpha=-lr)
            return s
        s.buf.mul_(h.momentum).add_(g)
        p.add_(s.buf, alpha=-lr)
        return s


class AdagradRule:
    hypers = (Adagrad,)
    records = (AdagradState,)
    sparse = True
    reference = staticmethod(upstream.adagrad)

    @staticmethod
    def torch_equivalent(h: Adagrad):
        return torch.optim.Adagrad, dict(lr=h.lr, eps=h.eps, fused=True)

    @staticmethod
    def native(h) -> bool:
        return False

    @staticmethod
    def init(h: Adagrad, p):
        return AdagradState(torch.zeros_like(p))

    @staticmethod
    def update_many(h: Adagrad, lr, ss, ps, gs, uniform: bool = False):
        if fusable(ps[:1] if uniform else ps):
            # torch.optim.Adagrad(fused=True)'s kernel: G += g*g; p -= lr * g / (sqrt(G) + eps)
            # (no learning-rate decay, so the step count it reads is irrelevant: 1).
            sums = [s.sum for s in ss]
            for pl, gl, sl in ([(ps, gs, sums)] if uniform else by_device_dtype(ps, gs, sums)):
                one = torch.ones((), dtype=torch.float32, device=pl[0].device)
                torch._fused_adagrad_(pl, gl, sl, [one] * len(pl), lr=lr, lr_decay=0.0, weight_decay=0.0,
                                      eps=h.eps, maximize=False)
            return ss
        sums = [s.sum for s in ss]
        torch._foreach_addcmul_(sums, gs, gs, value=1.0)
        denom = torch._foreach_sqrt(sums)
        torch._foreach_add_(denom, h.eps)
        torch._foreach_addcdiv_(ps, gs, denom, value=-lr)
        return ss

    @staticmethod
    def update_sparse(h: Adagrad, lr: float, s, p: torch.Tensor, g: torch.Tensor):
        """torch.optim.Adagrad's sparse form, on the rows the gradient holds: with ``g``
        coalesced (values ``u`` at indices ``k``), ``G[k] += u*u``; ``p[k] += -lr * u /
        (sqrt(G[k]) + eps)``; rows the gradient does not hold keep ``G`` and ``p``."""
        g = g.coalesce()
        at, u = g._indices(), g._values()
        s.sum.add_(torch.sparse_coo_tensor(at, u.pow(2), g.shape, check_invariants=False))
        denom = s.sum.sparse_mask(g)._values().sqrt_().add_(h.eps)
        p.add_(torch.sparse_coo_tensor(at, u / denom, g.shape, check_invariants=False), alpha=-lr)
        return s


class RMSPropRule:
    sparse = False
    hypers = (RMSProp,)
    records = (RMSPropState,)
    reference = staticmethod(upstream.rmsprop)

    @staticmethod
    def torch_equivalent(h: RMSProp):
        return torch.optim.RMSprop, dict(lr=h.lr, alpha=h.decay, eps=h.eps)

    @staticmethod
    def native(h) -> bool:
        return False

    @staticmethod
    def init(h: RMSProp, p):
        return RMSPropState(torch.zeros_like(p))

    @staticmethod
    def update_many(h: RMSProp, lr, ss, ps, gs, uniform: bool = False):
        avgs = [s.avg for s in ss]
        torch._foreach_mul_(avgs, h.decay)
        torch._foreach_addcmul_(avgs, gs, gs, value=1.0 - h.decay)
        denom = torch._foreach_sqrt(avgs)
        torch._foreach_add_(denom, h.eps)
        torch._foreach_addcdiv_(ps, gs, denom, value=-lr)
        return ss


def _adam_scalars(h, s: AdamState) -> tuple[AdamState, float, float, float]:
    """Advance ``t`` and the powers; return (record, step size, eps term, ``1/sqrt(c2)``)."""
    b1p, b2p = s.beta1_power * h.beta1, s.beta2_power * h.beta2
    c1, root_c2 = 1.0 - b1p, math.sqrt(1.0 - b2p)
    return AdamState(s.step + 1, s.m, s.v, b1p, b2p), root_c2 / c1, h.eps * root_c2, 1.0 / root_c2


_ZERO_BELOW: dict = {}  # dtype -> the largest float that rounds to 0 in it


def _underflows(x: float, dtype: torch.dtype) -> bool:
    """Whether the positive ``x`` rounds to 0 in ``dtype`` (half the smallest subnormal)."""
    limit = _ZERO_BELOW.get(dtype)
    if limit is None:
        info = torch.finfo(dtype)
        limit = _ZERO_BELOW[dtype] = info.smallest_normal * info.eps / 2
    return x <= limit


def _fused_adam(h, lr: float, ss: list, ps, gs) -> list:
    """Adam/AdamW by torch's fused kernel (see fused.py); the records advance as always."""
    news = [AdamState(s.step + 1, s.m, s.v, s.beta1_power * h.beta1, s.beta2_power * h.beta2) for s in ss]
    fused_adam_kernel(ps, gs, [s.m for s in ss], [s.v for s in ss], [n.step for n in news],
                      adamw=isinstance(h, AdamW), lr=lr, beta1=h.beta1, beta2=h.beta2,
                      weight_decay=getattr(h, "weight_decay", 0.0), eps=h.eps)
    return news


class AdamRule:
    hypers = (Adam, AdamW)
    records = (AdamState,)
    sparse = False  # as torch.optim.Adam(W): refused (SparseAdam is another rule)
    reference = staticmethod(upstream.adam)

    @staticmethod
    def torch_equivalent(h):
        if isinstance(h, AdamW):
            return torch.optim.AdamW, dict(lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps,
                                           weight_decay=h.weight_decay, fused=True)
        return torch.optim.Adam, dict(lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps, fused=True)

    @staticmethod
    def native(h) -> bool:
        return True

    @staticmethod
    def init(h, p):
        return AdamState(0, torch.zeros_like(p), torch.zeros_like(p))

    # The folded form ``m / (sqrt(v) + eps*sqrt(c2))`` saves a pass, but ``eps*sqrt(c2)``
    # can round to 0 in the parameter's dtype (eps=1e-45 in binary32), where a zero
    # gradient would give 0/0. Such a tensor takes upstream's form instead:
    # ``(lr/c1) * m / (sqrt(v)*(1/sqrt(c2)) + eps)``, which keeps it finite.
    @staticmethod
    def update_many(h, lr, ss: list, ps, gs, uniform: bool = False):
        if fusable(ps[:1] if uniform else ps):
            return _fused_adam(h, lr, ss, ps, gs)
        if isinstance(h, AdamW):
            torch._foreach_mul_(ps, 1.0 - lr * h.weight_decay)
        news, scalars = [], []
        for s, p in zip(ss, ps):
            n, scale, eps, inv_root_c2 = _adam_scalars(h, s)
            news.append(n)
            scalars.append((scale, eps, inv_root_c2, _underflows(eps, p.dtype)))
        ms, vs = [s.m for s in ss], [s.v for s in ss]
        torch._foreach_lerp_(ms, gs, 1.0 - h.beta1)
        torch._foreach_mul_(vs, h.beta2)
        torch._foreach_addcmul_(vs, gs, gs, value=1.0 - h.beta2)
        folded = [k for k, x in enumerate(scalars) if not x[3]]
        if len(folded) == len(ss):  # the usual case: one pass per operation
            denom = torch._foreach_sqrt(vs)
            torch._foreach_add_(denom, [x[1] for x in scalars])
            torch._foreach_addcdiv_(ps, ms, denom, [-(lr * x[0]) for x in scalars])
            return news
        for k, (scale, eps, inv_root_c2, tiny) in enumerate(scalars):  # rare: a tiny eps
            if tiny:
                denom = vs[k].sqrt().mul_(inv_root_c2).add_(h.eps)
                ps[k].addcdiv_(ms[k], denom, value=-(lr * (scale * inv_root_c2)))
            else:
                ps[k].addcdiv_(ms[k], vs[k].sqrt().add_(eps), value=-(lr * scale))
        return news


class AdadeltaRule:
    sparse = False
    hypers = (Adadelta,)
    records = (AdadeltaState,)
    reference = staticmethod(upstream.adadelta)

    @staticmethod
    def torch_equivalent(h: Adadelta):
        return torch.optim.Adadelta, dict(lr=h.lr, rho=h.rho, eps=h.eps)

    @staticmethod
    def native(h) -> bool:
        return False

    @staticmethod
    def init(h: Adadelta, p):
        return AdadeltaState(torch.zeros_like(p), torch.zeros_like(p))

    @staticmethod
    def update_many(h: Adadelta, lr, ss, ps, gs, uniform: bool = False):
        sq, da = [s.square_avg for s in ss], [s.delta_avg for s in ss]
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


# ---------------------------------------------------------------------- registry
# The one table of rules. Each declares the hyperparameter records it serves, the
# state records it makes (their class names are their checkpoint names), its upstream
# formula, its torch.optim equivalent and whether it has a native (device) path;
# checkpoints, the optimizer, ``check``, the command and the tests read everything from
# here. A new optimizer: a Hyper record (hyper.py), a state record (records.py), a rule
# here (or in a module of its own: lion_rule.py), a constructor of the kind's name (optim/__init__.py).
RULES = (SGDRule, AdagradRule, RMSPropRule, AdamRule, AdadeltaRule, LionRule)

_BY_HYPER = {h: rule for rule in RULES for h in rule.hypers}
HYPERS: dict[str, type] = {h.kind: h for rule in RULES for h in rule.hypers}
RECORDS: dict[str, type] = {r.__name__: r for rule in RULES for r in rule.records}


def rule_for(h: Hyper):
    return _BY_HYPER[type(h)]


def record_type(h: Hyper) -> type:
    """The state record a rule keeps for ``h``, from its declaration (no tensor made):
    the rule's one record, or what its ``record_type`` picks (SGD: momentum or not)."""
    rule = rule_for(h)
    pick = getattr(rule, "record_type", None)
    return pick(h) if pick is not None else rule.records[0]
