"""Rules that run torch.optim's own implementations, for the optimizers torch has and
upstream does not: NAdam, RAdam, Adamax, ASGD and Rprop through their ``foreach`` forms
(torch has no fused kernel for them), Muon through its per-matrix form. Calling torch's
functional forms with the records' buffers gives ``torch.optim.X(foreach=True)``'s bits by
construction; the records keep the step counts (and NAdam's, ASGD's binary32 scalars) on
the host, as torch keeps them when it is not capturing CUDA graphs.

A record's scalars are rebuilt as the host tensors torch keeps (``scalar_dtype``) for
the call and read back from those host tensors after it: no device read.
"""

from __future__ import annotations

import torch

from .hyper import AdamW
from .hyper_torch import ASGD, Adafactor, Adamax, Muon, NAdam, RAdam, Rprop
from .records import AdafactorState, AdafactorVectorState, state_shape, AdamaxState, AdamState, ASGDState, MuonState, NAdamState, RAdamState, RpropState
from .muon_torch import MuonWithAdamW
from .kernels import foreach, fused_adam, host_counter, scalar_dtype, step_tensors, torch_flags


def _functional(module: str, name: str):
    import importlib
    return getattr(importlib.import_module(f"torch.optim.{module}"), name)


def _pairs(h, *names: str) -> dict:
    return {n: getattr(h, n) for n in names}


class _TorchRule:
    """What every rule here shares: no upstream formula, no native path, dense gradients,
    elementwise (a tensor alone gets the bits it gets in a group; sharding may cut it)."""

    reference = None
    sparse = False
    elementwise = True

    @staticmethod
    def native(h) -> bool:
        return False


class NAdamRule(_TorchRule):
    hypers = (NAdam,)
    records = (NAdamState,)

    @staticmethod
    def torch_equivalent(h: NAdam):
        return torch.optim.NAdam, dict(lr=h.lr, betas=(h.beta1, h.beta2), **torch_flags(h), **_pairs(
            h, "eps", "weight_decay", "momentum_decay", "decoupled_weight_decay", "maximize"))

    @staticmethod
    def init(h: NAdam, p):
        return NAdamState(0, torch.zeros_like(p, memory_format=torch.preserve_format),
                          torch.zeros_like(p, memory_format=torch.preserve_format))

    @staticmethod
    def update_many(h: NAdam, lr, ss, ps, gs, uniform: bool = False):
        mus = [host_counter(s.mu_product) for s in ss]
        _functional("nadam", "nadam")(
            list(ps), list(gs), [s.m for s in ss], [s.v for s in ss], mus, step_tensors(ss), foreach=foreach(h),
            decoupled_weight_decay=h.decoupled_weight_decay, maximize=h.maximize, beta1=h.beta1, beta2=h.beta2,
            lr=lr, weight_decay=h.weight_decay, momentum_decay=h.momentum_decay, eps=h.eps)
        # a host tensor's value, not a device read
        return [NAdamState(s.step + 1, s.m, s.v, mu.item()) for s, mu in zip(ss, mus)]


class RAdamRule(_TorchRule):
    hypers = (RAdam,)
    records = (RAdamState,)

    @staticmethod
    def torch_equivalent(h: RAdam):
        return torch.optim.RAdam, dict(lr=h.lr, betas=(h.beta1, h.beta2), **torch_flags(h), **_pairs(
            h, "eps", "weight_decay", "decoupled_weight_decay", "maximize"))

    @staticmethod
    def init(h: RAdam, p):
        return RAdamState(0, torch.zeros_like(p, memory_format=torch.preserve_format),
                          torch.zeros_like(p, memory_format=torch.preserve_format))

    @staticmethod
    def update_many(h: RAdam, lr, ss, ps, gs, uniform: bool = False):
        _functional("radam", "radam")(
            list(ps), list(gs), [s.m for s in ss], [s.v for s in ss], step_tensors(ss), foreach=foreach(h),
            decoupled_weight_decay=h.decoupled_weight_decay, maximize=h.maximize, beta1=h.beta1, beta2=h.beta2,
            lr=lr, weight_decay=h.weight_decay, eps=h.eps)
        return [RAdamState(s.step + 1, s.m, s.v) for s in ss]


class AdamaxRule(_TorchRule):
    hypers = (Adamax,)
    records = (AdamaxState,)

    @staticmethod
    def torch_equivalent(h: Adamax):
        return torch.optim.Adamax, dict(lr=h.lr, betas=(h.beta1, h.beta2), **torch_flags(h), **_pairs(
            h, "eps", "weight_decay", "maximize"))

    @staticmethod
    def init(h: Adamax, p):
        return AdamaxState(0, torch.zeros_like(p, memory_format=torch.preserve_format),
                           torch.zeros_like(p, memory_format=torch.preserve_format))

    @staticmethod
    def update_many(h: Adamax, lr, ss, ps, gs, uniform: bool = False):
        _functional("adamax", "adamax")(
            list(ps), list(gs), [s.m for s in ss], [s.u for s in ss], step_tensors(ss), foreach=foreach(h),
            maximize=h.maximize, eps=h.eps, beta1=h.beta1, beta2=h.beta2, lr=lr, weight_decay=h.weight_decay)
        return [AdamaxState(s.step + 1, s.m, s.u) for s in ss]


class ASGDRule(_TorchRule):
    """ASGD: ``eta`` starts at the rate of the first step (torch reads the group's rate
    then); afterwards eta and mu follow from the step count, computed on the host by
    torch's own expressions over its binary32 step tensor."""

    hypers = (ASGD,)
    records = (ASGDState,)

    @staticmethod
    def torch_equivalent(h: ASGD):
        return torch.optim.ASGD, dict(lr=h.lr, **torch_flags(h), **_pairs(
            h, "lambd", "alpha", "t0", "weight_decay", "maximize"))

    @staticmethod
    def init(h: ASGD, p):
        return ASGDState(0, torch.zeros_like(p, memory_format=torch.preserve_format), _binary32(h.lr), 1.0)

    @staticmethod
    def update_many(h: ASGD, lr, ss, ps, gs, uniform: bool = False):
        dtype, device = scalar_dtype(), ps[0].device
        uploads: dict = {}  # one device scalar per distinct value (torch only reads and overwrites them)

        def upload(value: float) -> torch.Tensor:
            if not foreach(h):  # torch's loop overwrites each tensor's eta before the next reads its own
                return torch.tensor(value, dtype=dtype, device=device)  # an upload, never a read
            if value not in uploads:
                uploads[value] = torch.tensor(value, dtype=dtype, device=device)  # an upload, never a read
            return uploads[value]

        etas = [upload(_binary32(lr) if s.step == 0 else s.eta) for s in ss]
        mus = [upload(s.mu) for s in ss]
        steps = step_tensors(ss)
        _functional("asgd", "asgd")(
            list(ps), list(gs), [s.ax for s in ss], mus, etas, steps, foreach=foreach(h), maximize=h.maximize,
            lambd=h.lambd, lr=lr, t0=h.t0, alpha=h.alpha, weight_decay=h.weight_decay)
        after: dict = {}  # step reached -> (eta, mu), by torch's own expressions on the host
        for s, step in zip(ss, steps):
            if s.step + 1 not in after:
                eta = host_counter(0.0)
                at = step if foreach(h) else step.item()  # the loop computes in Python floats (a host tensor)
                eta.copy_(torch.as_tensor(lr / ((1 + h.lambd * lr * at) ** h.alpha)))
                after[s.step + 1] = (eta.item(), host_counter(1 / max(1, s.step + 1 - h.t0)).item())
        return [ASGDState(s.step + 1, s.ax, *after[s.step + 1]) for s in ss]


def _binary32(x: float) -> float:
    return host_counter(x).item()  # a host conversion, not a device read


class RpropRule(_TorchRule):
    """Rprop: each element's step size starts at the rate of the first step (torch fills
    it then) and is adapted from the gradient's signs; the rate is not read afterwards."""

    hypers = (Rprop,)
    records = (RpropState,)

    @staticmethod
    def torch_equivalent(h: Rprop):
        return torch.optim.Rprop, dict(lr=h.lr, etas=(h.etaminus, h.etaplus), step_sizes=(
            h.step_size_min, h.step_size_max), **torch_flags(h), maximize=h.maximize)

    @staticmethod
    def init(h: Rprop, p):
        return RpropState(0, torch.zeros_like(p, memory_format=torch.preserve_format),
                          torch.full_like(p, h.lr, memory_format=torch.preserve_format))

    @staticmethod
    def update_many(h: Rprop, lr, ss, ps, gs, uniform: bool = False):
        for s in ss:
            if s.step == 0:
                s.step_size.fill_(lr)
        _functional("rprop", "rprop")(
            list(ps), list(gs), [s.prev for s in ss], [s.step_size for s in ss], step_tensors(ss), foreach=foreach(h),
            maximize=h.maximize, step_size_min=h.step_size_min, step_size_max=h.step_size_max,
            etaminus=h.etaminus, etaplus=h.etaplus)
        return [RpropState(s.step + 1, s.prev, s.step_size) for s in ss]


class MuonRule(_TorchRule):
    """Muon on 2-D slots (torch.optim.Muon's form: momentum, Newton-Schulz on the whole
    matrix in bfloat16, decoupled decay, the shape-adjusted rate), AdamW on every other
    slot (torch's fused kernel). Not elementwise: sharding that cuts a matrix is refused."""

    hypers = (Muon,)
    records = (MuonState, AdamState)
    elementwise = False

    @staticmethod
    def record_type(h: Muon, shape=None) -> type:
        return MuonState if shape is None or len(shape) == 2 else AdamState

    @staticmethod
    def fallback(h: Muon) -> AdamW:
        return AdamW(h.lr, h.weight_decay, h.adamw_beta1, h.adamw_beta2, h.adamw_eps)

    @staticmethod
    def torch_equivalent(h: Muon):
        return MuonWithAdamW, dict(lr=h.lr, weight_decay=h.weight_decay, momentum=h.momentum, nesterov=h.nesterov,
                                   ns_coefficients=(h.ns_a, h.ns_b, h.ns_c), eps=h.eps, ns_steps=h.ns_steps,
                                   adjust_lr_fn=h.adjust_lr_fn, adamw_betas=(h.adamw_beta1, h.adamw_beta2),
                                   adamw_eps=h.adamw_eps)

    @staticmethod
    def init(h: Muon, p):
        if p.dim() == 2:
            return MuonState(torch.zeros_like(p, memory_format=torch.preserve_format))
        return AdamState(0, torch.zeros_like(p), torch.zeros_like(p))

    @staticmethod
    def update_many(h: Muon, lr, ss, ps, gs, uniform: bool = False):
        out = list(ss)
        mats = [k for k, p in enumerate(ps) if p.dim() == 2]
        rest = [k for k, p in enumerate(ps) if p.dim() != 2]
        if mats:
            # torch keeps a tensor rate a float32 tensor: its shape ratio and decay factor round there
            rate = torch.tensor(lr, dtype=torch.float32) if h.tensor_lr else lr  # a host tensor, no device
            _functional("_muon", "muon")(
                [ps[k] for k in mats], [gs[k] for k in mats], [ss[k].buf for k in mats], lr=rate,
                weight_decay=h.weight_decay, momentum=h.momentum, nesterov=h.nesterov,
                ns_coefficients=(h.ns_a, h.ns_b, h.ns_c), eps=h.eps, ns_steps=h.ns_steps,
                adjust_lr_fn=h.adjust_lr_fn, has_complex=False)
        if rest:
            news = fused_adam(MuonRule.fallback(h), lr, [ss[k] for k in rest], [ps[k] for k in rest],
                               [gs[k] for k in rest])
            for k, n in zip(rest, news):
                out[k] = n
        return out


class AdafactorRule(_TorchRule):
    """Adafactor through torch's foreach form. Its factored state is not shaped like the
    parameter (a row and a column per matrix): sharding that cuts a slot is refused.
    torch's form reads two norms per tensor to the host every update (the parameter's RMS
    for its relative step, the update's RMS for its clipping: ``.norm().item()``): two
    intentional device reads per tensor per update, as with ``torch.optim.Adafactor``."""

    hypers = (Adafactor,)
    host_reads = 2  # per tensor per update (see above)
    records = (AdafactorState, AdafactorVectorState)
    elementwise = False

    @staticmethod
    def record_type(h: Adafactor, shape=None) -> type:
        return AdafactorState if shape is None or len(shape) > 1 else AdafactorVectorState

    @staticmethod
    def torch_equivalent(h: Adafactor):
        return torch.optim.Adafactor, dict(lr=h.lr, beta2_decay=h.beta2_decay, eps=(h.eps1, h.eps2), d=h.d,
                                           weight_decay=h.weight_decay, maximize=h.maximize, **torch_flags(h))

    @staticmethod
    def init(h: Adafactor, p):
        if p.dim() > 1:
            return AdafactorState(0, p.new_zeros(state_shape(AdafactorState, "row_var", p.shape)),
                                  p.new_zeros(state_shape(AdafactorState, "col_var", p.shape)))
        return AdafactorVectorState(0, torch.zeros_like(p, memory_format=torch.preserve_format))

    @staticmethod
    def update_many(h: Adafactor, lr, ss, ps, gs, uniform: bool = False):
        factored = [isinstance(s, AdafactorState) for s in ss]
        _functional("_adafactor", "adafactor")(
            list(ps), list(gs), [s.row_var if f else None for s, f in zip(ss, factored)],
            [s.col_var if f else None for s, f in zip(ss, factored)],
            [None if f else s.variance for s, f in zip(ss, factored)], step_tensors(ss), foreach=foreach(h),
            d=h.d, lr=lr, beta2_decay=h.beta2_decay, weight_decay=h.weight_decay, eps1=h.eps1, eps2=h.eps2,
            maximize=h.maximize)
        return [type(s)(s.step + 1, *s.tensors().values()) for s in ss]


RULES = (NAdamRule, RAdamRule, AdamaxRule, ASGDRule, RpropRule, AdafactorRule, MuonRule)
