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
  update (``None``: no equivalent; ``leantrain check`` says so), with the ``fused``/
  ``foreach`` flag of the implementation it runs (``kernels.torch_flags``);
* ``native(h)``: whether it has the device-resident path; ``sparse``: whether it takes
  sparse gradients (``update_sparse``).

The tensors a rule is handed are dense in one layout (``params/dense.py``: the kernels
pair elements by memory position) and every one has a gradient (the shell leaves a slot
without one out). No parameter-sized temporary is allocated except where a formula
needs one (a denominator, Lion's interpolation).

What runs. On the devices torch's fused kernels take (its own list: CPU, CUDA, MPS,
XPU...) SGD (with or without momentum), Adagrad, Adam and AdamW run torch's fused kernels
(``kernels.py``), the bits of ``torch.optim.*(fused=True)``, except SGD on CPU
bfloat16/float16 (torch's per-tensor form: its fused kernel leaves elements unwritten):

* SGD:       ``p += -lr * g``; momentum ``b = b*mu + g``, ``p += -lr * b``
* Adagrad:   ``G += g*g``; ``p -= lr * g / (sqrt(G) + eps)``
* Adam:      ``m = lerp(m, g, 1-b1)``; ``v = v*b2 + (1-b2)*g*g``; ``p -= (lr/c1) * m /
  (sqrt(v)/sqrt(c2) + eps)`` with ``c = 1 - b^t`` in binary64; AdamW first ``p *= 1 - lr*wd``

On other devices these four run torch's own functional foreach forms (``torch.optim.adam.adam(...,
foreach=True)`` and the like), the bits of ``torch.optim.*(foreach=True)``: tested on CPU
by taking CPU off the fused device list. ``implementation`` (torch's ``fused=``/
``foreach=`` by name) runs any of torch's forms on purpose. The other rules run torch's
foreach form (RMSprop and Adadelta in ``square_average_rules.py``, the rest in
``torch_rules.py``), and Lion, which torch has not, its own:

* Lion:      ``p *= 1 - lr*wd``; ``c = lerp(m, g, 1-b1)``; ``p += -lr * sign(c)``;
  ``m = lerp(m, g, 1-b2)`` (``lion_rule.py``)

torch's options beyond upstream's formulas (weight decay, ``maximize``, Nesterov,
dampening, AMSGrad, Adagrad's rate decay) are arguments of the same kernels and forms.
"""

from __future__ import annotations

from typing import Sequence

import torch

import torch.optim

from ..errors import ConfigError
from .reference import FORMULAS as upstream
from .kernels import (
    advanced, by_device_dtype, check_fused, decoupled, fusable, fused_adam, has_options, step_tensors, torch_flags,
    torch_options,
)
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
        # torch's foreach form tells a buffer's first step (it copies the gradient, and a
        # group with one such slot takes the per-tensor path): those records count steps
        counted = h.dampening != 0.0 or h.implementation == "foreach"
        return DampenedMomentumState if counted else MomentumState
    reference = staticmethod(upstream.sgd)

    @staticmethod
    def torch_equivalent(h: SGD):
        return torch.optim.SGD, dict(lr=h.lr, momentum=h.momentum, **torch_flags(h), **torch_options(h))

    @staticmethod
    def native(h: SGD) -> bool:
        return h.momentum == 0.0  # plain SGD only: momentum has no device path

    @staticmethod
    def init(h: SGD, p: torch.Tensor):
        check_fused(h, p)
        if h.implementation == "fused" and _cpu_half([p]):
            raise ConfigError(f"optim.sgd: fused=True on a CPU {str(p.dtype).removeprefix('torch.')} parameter: "
                              f"torch 2.13's fused SGD kernel there writes only each tensor's scalar tail (the "
                              f"rest never trains); use foreach=False (torch's default there) or foreach=True")
        if h.momentum == 0.0:
            return SGDState()
        buf = torch.zeros_like(p, memory_format=torch.preserve_format)
        return MomentumState(buf) if SGDRule.record_type(h) is MomentumState else DampenedMomentumState(0, buf)

    @staticmethod
    def update_many(h: SGD, lr: float, ss: list, ps: Tensors, gs: Tensors, uniform: bool = False) -> list:
        # A zero buffer makes the first momentum step ``b = g`` as torch's copy does, except
        # with dampening (``b = (1-d)*g`` later on): those records count their steps and
        # their first step is the kernel's ``is_first_step``.
        form = h.implementation
        if form in ("foreach", "for-loop"):  # torch's form by name
            return _torch_sgd(h, lr, ss, list(ps), list(gs), foreach=form == "foreach")
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
            # torch.optim.SGD(fused=True)'s kernel, in one pass
            bufs = [] if h.momentum == 0.0 else [s.buf for s in ss]
            if not dampened:  # the usual case: one call, no first step to tell apart
                _fused_sgd(h, lr, ps, gs, bufs, uniform, False)
                return ss
            first = [s.step == 0 for s in ss]
            for flag in sorted(set(first)):
                pick = [k for k, f in enumerate(first) if f == flag]
                _fused_sgd(h, lr, [ps[k] for k in pick], [gs[k] for k in pick], [bufs[k] for k in pick], uniform, flag)
            return [DampenedMomentumState(s.step + 1, s.buf) for s in ss]
        return _torch_sgd(h, lr, ss, list(ps), list(gs), foreach=True)  # no fused kernel here: torch's foreach

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
        return torch.optim.Adagrad, dict(lr=h.lr, eps=h.eps, **torch_flags(h), **torch_options(h))

    @staticmethod
    def native(h) -> bool:
        return False

    @staticmethod
    def init(h: Adagrad, p):
        check_fused(h, p, cuda=False)
        total = torch.full_like(p, h.initial_accumulator_value, memory_format=torch.preserve_format)
        return AdagradState(total) if h.lr_decay == 0.0 else AdagradStepState(0, total)

    @staticmethod
    def update_many(h: Adagrad, lr, ss, ps, gs, uniform: bool = False):
        counted = h.lr_decay != 0.0
        news = [AdagradStepState(s.step + 1, s.sum) for s in ss] if counted else ss
        if h.implementation in (None, "fused") and fusable(ps[:1] if uniform else ps, cuda=False):
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
        import torch.optim.adagrad as F  # torch's foreach (or per-tensor) form

        F.adagrad(list(ps), list(gs), [s.sum for s in ss], step_tensors(ss), foreach=h.implementation != "for-loop",
                  lr=lr, weight_decay=h.weight_decay, lr_decay=h.lr_decay, eps=h.eps, maximize=h.maximize)
        return news

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
        return fused_adam if h.implementation in (None, "fused") and fusable(ps[:1]) else None

    @staticmethod
    def torch_equivalent(h):
        if isinstance(h, AdamW):
            return torch.optim.AdamW, dict(lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps,
                                           weight_decay=h.weight_decay, **torch_flags(h), **torch_options(h))
        return torch.optim.Adam, dict(lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps, **torch_flags(h),
                                      **torch_options(h))

    @staticmethod
    def native(h) -> bool:
        return True

    @staticmethod
    def init(h, p):
        check_fused(h, p)
        if h.amsgrad:
            return AMSGradState(0, torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p))
        return AdamState(0, torch.zeros_like(p), torch.zeros_like(p))

    @staticmethod
    def update_many(h, lr, ss: list, ps, gs, uniform: bool = False):
        if h.implementation in (None, "fused") and fusable(ps[:1] if uniform else ps):
            return fused_adam(h, lr, ss, ps, gs)
        import torch.optim.adam as F  # torch's foreach (or per-tensor) form

        news = advanced(h, ss)
        F.adam(list(ps), list(gs), [s.m for s in ss], [s.v for s in ss], [s.vmax for s in ss] if h.amsgrad else [],
               step_tensors(ss), foreach=h.implementation != "for-loop", decoupled_weight_decay=decoupled(h),
               amsgrad=h.amsgrad, beta1=h.beta1, beta2=h.beta2, lr=lr, weight_decay=h.weight_decay, eps=h.eps,
               maximize=h.maximize)
        return news
