"""Upstream's rules with torch's fused kernels: SGD, Adagrad, Adam and AdamW, with every
option torch gives them (``rules.py`` holds the one table of all rules).

Each rule is a class of static functions over one kind's hyperparameters ``h``:

* ``init(h, p)``: the zero state record of one tensor;
* ``update_many(h, lr, records, ps, gs, uniform)``: the update of a group of tensors,
  in place (``uniform``: one device and dtype, as the optimizer's groups are), returning
  the new records. Every form is elementwise: a tensor alone gets the bits it gets in a
  group (tested), so there is no separate per-tensor form;
* ``steady_kernel(h, ps)`` (optional, Adam/AdamW): the function ``update_many`` would
  run for a layout group's targets, chosen once with the layout (``optim/layout.py``);
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
and AdamW run torch's fused kernels (``kernels.py``), the bits of ``torch.optim.*(fused=
True)``:

* SGD:       ``p += -lr * g``; momentum ``b = b*mu + g``, ``p += -lr * b``
* Adagrad:   ``G += g*g``; ``p -= lr * g / (sqrt(G) + eps)``
* Adam:      ``m = lerp(m, g, 1-b1)``; ``v = v*b2 + (1-b2)*g*g``; ``p -= (lr/c1) * m /
  (sqrt(v)/sqrt(c2) + eps)`` with ``c = 1 - b^t`` in binary64; AdamW first ``p *= 1 - lr*wd``

On other devices and dtypes these four fall back to ``torch._foreach_*`` forms of the
same formulas (Adam's folded as ``p += -(lr*sqrt(c2)/c1) * m / (sqrt(v) + eps*sqrt(c2))``);
the fallbacks are tested against the fused kernels on CPU by forcing them. The other
rules have one form, on every device (RMSprop and Adadelta in ``square_average_rules.py``):

* Lion:      ``p *= 1 - lr*wd``; ``c = lerp(m, g, 1-b1)``; ``p += -lr * sign(c)``;
  ``m = lerp(m, g, 1-b2)`` (``lion_rule.py``)

torch's options beyond upstream's formulas (weight decay, ``maximize``, Nesterov,
dampening, AMSGrad, Adagrad's rate decay) are arguments of the same fused kernels; off
those kernels' devices they run torch's own foreach forms.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

import torch.optim

from .reference import FORMULAS as upstream
from .kernels import advanced, by_device_dtype, decoupled, fusable, fused_adam, has_options, step_tensors, torch_options
from .hyper import Adagrad, Adam, AdamW, SGD
from .records import AdagradState, AdagradStepState, AdamState, AMSGradState, DampenedMomentumState, MomentumState, SGDState

Tensors = Sequence[torch.Tensor]


# ------------------------------------------------------------------------- rules
class SGDRule:
    hypers = (SGD,)
    records = (SGDState, MomentumState, DampenedMomentumState)
    sparse = True  # takes sparse gradients (update_sparse), as torch.optim.SGD does

    @staticmethod
    def record_type(h: SGD) -> type:
        if h.momentum == 0.0:
            return SGDState
        return MomentumState if h.dampening == 0.0 else DampenedMomentumState
    reference = staticmethod(upstream.sgd)

    @staticmethod
    def torch_equivalent(h: SGD):
        return torch.optim.SGD, dict(lr=h.lr, momentum=h.momentum, fused=True, **torch_options(h))

    @staticmethod
    def native(h: SGD) -> bool:
        return h.momentum == 0.0  # plain SGD only: momentum has no device path

    @staticmethod
    def init(h: SGD, p: torch.Tensor):
        if h.momentum == 0.0:
            return SGDState()
        buf = torch.zeros_like(p, memory_format=torch.preserve_format)
        return MomentumState(buf) if h.dampening == 0.0 else DampenedMomentumState(0, buf)

    @staticmethod
    def update_many(h: SGD, lr: float, ss: list, ps: Tensors, gs: Tensors, uniform: bool = False) -> list:
        # A zero buffer makes the first momentum step ``b = g`` as torch's copy does, except
        # with dampening (``b = (1-d)*g`` later on): those records count their steps and
        # their first step is the kernel's ``is_first_step``.
        dampened = h.momentum != 0.0 and h.dampening != 0.0
        half = _cpu_half(ps[:1] if uniform else ps)
        if half and uniform:
            half = list(range(len(ps)))
        if half:  # torch's per-tensor form there: its fused kernel leaves elements unwritten
            if len(half) == len(ps):
                return _torch_sgd(h, lr, ss, list(ps), list(gs), foreach=False)
            out = list(ss)
            for k, new in zip(half, _torch_sgd(h, lr, [ss[k] for k in half], [ps[k] for k in half],
                                               [gs[k] for k in half], foreach=False)):
                out[k] = new
            rest = sorted(set(range(len(ps))) - set(half))
            for k, new in zip(rest, SGDRule.update_many(h, lr, [ss[k] for k in rest], [ps[k] for k in rest],
                                                        [gs[k] for k in rest])):
                out[k] = new
            return out
        if fusable(ps[:1] if uniform else ps):
            # torch.optim.SGD(fused=True)'s kernel, in one pass (its rounding may differ from
            # the foreach passes below in the last bit; the fallback for other devices).
            bufs = [] if h.momentum == 0.0 else [s.buf for s in ss]
            if not dampened:  # the usual case: one call, no first step to tell apart
                _fused_sgd(h, lr, ps, gs, bufs, uniform, False)
                return ss
            first = [s.step == 0 for s in ss]
            for flag in sorted(set(first)):
                pick = [k for k, f in enumerate(first) if f == flag]
                _fused_sgd(h, lr, [ps[k] for k in pick], [gs[k] for k in pick], [bufs[k] for k in pick], uniform, flag)
            return [DampenedMomentumState(s.step + 1, s.buf) for s in ss]
        if h.momentum == 0.0 and not has_options(h):
            torch._foreach_add_(ps, gs, alpha=-lr)
            return ss
        if not has_options(h):
            bufs = [s.buf for s in ss]
            torch._foreach_mul_(bufs, h.momentum)
            torch._foreach_add_(bufs, gs)
            torch._foreach_add_(ps, bufs, alpha=-lr)
            return ss
        return _torch_sgd(h, lr, ss, list(ps), list(gs), foreach=True)

    @staticmethod
    def update_sparse(h: SGD, lr: float, s, p: torch.Tensor, g: torch.Tensor):
        """The per-tensor form, for a sparse gradient (``nn.Embedding(sparse=True)``) as for
        a dense one off the fused kernels' devices: torch.optim.SGD's ``p += -lr * g`` (a
        sparse ``g`` adds each stored value where it belongs). With momentum
        the buffer is dense (made at init), ``b = b*mu + g``; torch's starts as a sparse
        copy of the first gradient, so repeated rows may round differently there. Other
        options run torch's own per-tensor form."""
        if has_options(h):
            return _torch_sgd(h, lr, [s], [p], [g], foreach=False)[0]
        if h.momentum == 0.0:
            p.add_(g, alpha=-lr)
            return s
        s.buf.mul_(h.momentum).add_(g)
        p.add_(s.buf, alpha=-lr)
        return s


def _fused_sgd(h: SGD, lr: float, ps, gs, bufs, uniform: bool, first: bool) -> None:
    """torch.optim.SGD(fused=True)'s kernel over (device, dtype) groups."""
    for group in ([(ps, gs, bufs)] if uniform else by_device_dtype(ps, gs, bufs)):
        torch._fused_sgd_(*group, weight_decay=h.weight_decay, momentum=h.momentum, lr=lr, dampening=h.dampening,
                          nesterov=h.nesterov, maximize=h.maximize, is_first_step=first)


def _cpu_half(ps) -> list:
    """The indices of CPU bfloat16 and float16 tensors. torch 2.13's fused SGD kernel there
    writes only each tensor's scalar tail (a 64-element tensor moves 0 elements, a
    67-element one 3) and, with momentum, reads memory it never wrote: those tensors take
    torch's per-tensor form, ``torch.optim.SGD(foreach=False)`` (torch's own default on
    CPU), with its bits whenever each parameter's first gradient comes."""
    return [k for k, p in enumerate(ps) if p.is_cpu and p.dtype in (torch.bfloat16, torch.float16)]


def _torch_sgd(h: SGD, lr: float, ss: list, ps: list, gs: list, foreach: bool) -> list:
    """torch.optim.SGD's own foreach (or per-tensor) form; a dampened record's first step
    hands torch no buffer, so torch copies the gradient, which the record then keeps."""
    import torch.optim.sgd as F
    first = [isinstance(s, DampenedMomentumState) and s.step == 0 for s in ss]
    bufs = [None if f or h.momentum == 0.0 else s.buf for s, f in zip(ss, first)]
    F.sgd(ps, gs, bufs, has_sparse_grad=any(g.is_sparse for g in gs), foreach=foreach, fused=False,
          weight_decay=h.weight_decay, momentum=h.momentum, lr=lr, dampening=h.dampening,
          nesterov=h.nesterov, maximize=h.maximize)
    if h.momentum == 0.0:
        return ss
    out = []
    for s, f, b in zip(ss, first, bufs):
        if f:
            s.buf.copy_(b.to_dense() if b.is_sparse else b)
        out.append(DampenedMomentumState(s.step + 1, s.buf) if isinstance(s, DampenedMomentumState) else s)
    return out


class AdagradRule:
    hypers = (Adagrad,)
    records = (AdagradState, AdagradStepState)
    sparse = True
    reference = staticmethod(upstream.adagrad)

    @staticmethod
    def record_type(h: Adagrad) -> type:
        return AdagradState if h.lr_decay == 0.0 else AdagradStepState  # the decay reads the step

    @staticmethod
    def sparse_refusal(h: Adagrad):
        """Why a sparse gradient cannot take this setting (``None``: it can)."""
        return "weight_decay (torch.optim.Adagrad refuses it with sparse gradients)" if h.weight_decay else None

    @staticmethod
    def torch_equivalent(h: Adagrad):
        return torch.optim.Adagrad, dict(lr=h.lr, eps=h.eps, fused=True, **torch_options(h))

    @staticmethod
    def native(h) -> bool:
        return False

    @staticmethod
    def init(h: Adagrad, p):
        total = torch.full_like(p, h.initial_accumulator_value, memory_format=torch.preserve_format)
        return AdagradState(total) if h.lr_decay == 0.0 else AdagradStepState(0, total)

    @staticmethod
    def update_many(h: Adagrad, lr, ss, ps, gs, uniform: bool = False):
        counted = h.lr_decay != 0.0
        news = [AdagradStepState(s.step + 1, s.sum) for s in ss] if counted else ss
        if fusable(ps[:1] if uniform else ps):
            # torch.optim.Adagrad(fused=True)'s kernel: G += g*g; p -= clr * g / (sqrt(G) + eps),
            # clr = lr / (1 + (t-1)*lr_decay) with t the step reached (1 without a decay).
            sums = [s.sum for s in ss]
            extra = [(t, float(n.step) if counted else 1.0) for t, n in zip(sums, news)]
            for pl, gl, el in ([(ps, gs, extra)] if uniform else by_device_dtype(ps, gs, extra)):
                sl, device = [e[0] for e in el], pl[0].device
                if counted:  # uploads, never reads
                    tl = [torch.tensor(e[1], dtype=torch.float32, device=device) for e in el]
                else:
                    tl = [torch.ones((), dtype=torch.float32, device=device)] * len(pl)
                torch._fused_adagrad_(pl, gl, sl, tl, lr=lr, lr_decay=h.lr_decay, weight_decay=h.weight_decay,
                                      eps=h.eps, maximize=h.maximize)
            return news
        if has_options(h):
            import torch.optim.adagrad as F
            F.adagrad(list(ps), list(gs), [s.sum for s in ss], step_tensors(ss), foreach=True, lr=lr,
                      weight_decay=h.weight_decay, lr_decay=h.lr_decay, eps=h.eps, maximize=h.maximize)
            return news
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
        (sqrt(G[k]) + eps)``; rows the gradient does not hold keep ``G`` and ``p``. Other
        options run torch's own per-tensor form."""
        if has_options(h):
            import torch.optim.adagrad as F
            F.adagrad([p], [g], [s.sum], step_tensors([s]), has_sparse_grad=True, foreach=False, lr=lr,
                      weight_decay=h.weight_decay, lr_decay=h.lr_decay, eps=h.eps, maximize=h.maximize)
            return AdagradStepState(s.step + 1, s.sum) if isinstance(s, AdagradStepState) else s
        g = g.coalesce()
        at, u = g._indices(), g._values()
        s.sum.add_(torch.sparse_coo_tensor(at, u.pow(2), g.shape, check_invariants=False))
        denom = s.sum.sparse_mask(g)._values().sqrt_().add_(h.eps)
        p.add_(torch.sparse_coo_tensor(at, u / denom, g.shape, check_invariants=False), alpha=-lr)
        return s


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


class AdamRule:
    hypers = (Adam, AdamW)
    records = (AdamState, AMSGradState)
    sparse = False  # as torch.optim.Adam(W): refused (SparseAdam is another rule)
    reference = staticmethod(upstream.adam)

    @staticmethod
    def record_type(h) -> type:
        return AMSGradState if h.amsgrad else AdamState

    @staticmethod
    def steady_kernel(h, ps):
        """What ``update_many`` runs on the targets ``ps`` of one layout group (one device
        and dtype) when every gradient is ready: torch's fused kernel where it takes them,
        decided once with the layout (``None``: ``update_many`` decides per update)."""
        return fused_adam if fusable(ps[:1]) else None

    @staticmethod
    def torch_equivalent(h):
        if isinstance(h, AdamW):
            return torch.optim.AdamW, dict(lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps,
                                           weight_decay=h.weight_decay, fused=True, **torch_options(h))
        return torch.optim.Adam, dict(lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps, fused=True, **torch_options(h))

    @staticmethod
    def native(h) -> bool:
        return True

    @staticmethod
    def init(h, p):
        if h.amsgrad:
            return AMSGradState(0, torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p))
        return AdamState(0, torch.zeros_like(p), torch.zeros_like(p))

    # The folded form ``m / (sqrt(v) + eps*sqrt(c2))`` saves a pass, but ``eps*sqrt(c2)``
    # can round to 0 in the parameter's dtype (eps=1e-45 in binary32), where a zero
    # gradient would give 0/0. Such a tensor takes upstream's form instead:
    # ``(lr/c1) * m / (sqrt(v)*(1/sqrt(c2)) + eps)``, which keeps it finite.
    @staticmethod
    def update_many(h, lr, ss: list, ps, gs, uniform: bool = False):
        if fusable(ps[:1] if uniform else ps):
            return fused_adam(h, lr, ss, ps, gs)
        if has_options(h):  # torch.optim.Adam's own foreach form
            import torch.optim.adam as F
            news = advanced(h, ss)
            F.adam(list(ps), list(gs), [s.m for s in ss], [s.v for s in ss], [s.vmax for s in ss] if h.amsgrad
                   else [], step_tensors(ss), foreach=True, decoupled_weight_decay=decoupled(h),
                   amsgrad=h.amsgrad, beta1=h.beta1, beta2=h.beta2, lr=lr, weight_decay=h.weight_decay,
                   eps=h.eps, maximize=h.maximize)
            return news
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
