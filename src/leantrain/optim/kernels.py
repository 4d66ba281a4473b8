"""torch's fused optimizer kernels and what the rules share around them.

``torch._fused_sgd_``, ``_fused_adagrad_``, ``_fused_adam_``, ``_fused_adamw_`` (what
``torch.optim.*(fused=True)`` runs) are called on (device, dtype) groups of tensors.
The kernels are elementwise, so one tensor alone gives the same bits as in a group: the
per-tensor rules call them too. Where they do not apply (another device type or dtype)
the rules keep their ``foreach`` form. Also here: torch's step counters as host
tensors, the torch options a record sets, and Adam/AdamW through the fused kernel
(also Muon's fallback), which a loop's layout may call directly (``steady_kernel``).
"""

from __future__ import annotations

import torch

from .hyper import AdamW
from .records import AdamState, AMSGradState

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _fused_devices() -> frozenset:
    """The device types torch's fused optimizer kernels take, by torch's own list."""
    from torch.optim import optimizer

    listed = getattr(optimizer, "_get_fused_kernels_supported_devices", None)
    return frozenset(listed() if listed is not None else ("cpu", "cuda"))


FUSED_DEVICES = _fused_devices()


def fusable(ps, cuda: bool = True) -> bool:
    """Whether the fused kernels take these tensors (a device type torch's fused kernels
    take, a float dtype); elsewhere the rules run torch's foreach forms. ``cuda=False``:
    a kernel torch has no CUDA form of (Adagrad's: ``torch.optim.Adagrad`` refuses
    ``fused=True`` there and runs its foreach form by default)."""
    for p in ps:  # a plain loop over tensor attributes: this runs every step
        if not (p.device.type in FUSED_DEVICES and p.dtype in DTYPES) or (not cuda and p.device.type == "cuda"):
            return False
    return True


def check_fused(h, p: torch.Tensor, cuda: bool = True) -> None:
    """Refuse ``fused=True`` for a parameter torch's fused kernels do not take (as torch does;
    ``cuda``: as ``fusable``)."""
    if h.implementation == "fused" and not fusable([p], cuda):
        from ..errors import ConfigError

        raise ConfigError(f"optim.{h.kind}: fused=True, but torch's fused kernels do not take a "
                          f"{str(p.dtype).removeprefix('torch.')} parameter on {p.device.type}; use foreach=True")


def foreach(h) -> bool:
    """Whether torch's functional form runs as foreach (else its per-tensor loop)."""
    return h.implementation != "for-loop"


def torch_flags(h) -> dict:
    """The ``fused``/``foreach`` arguments of the torch implementation ``h`` runs."""
    form = h.implementation or ("fused" if "fused" in h._forms else "foreach")
    return {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[form]


def by_device_dtype(ps, gs, extra) -> list[tuple[list, list, list]]:
    """``(params, grads, extras)`` per (device, dtype) group, in order (``extra`` may be empty)."""
    groups: dict[tuple, tuple[list, list, list]] = {}
    for k, (p, g) in enumerate(zip(ps, gs)):
        group = groups.setdefault((p.device, p.dtype), ([], [], []))
        group[0].append(p), group[1].append(g)
        if extra:
            group[2].append(extra[k])
    return list(groups.values())


def adam(ps, gs, ms, vs, steps: list[int], *, adamw: bool, lr: float, beta1: float, beta2: float,
         weight_decay: float, eps: float, vmaxs=None, maximize: bool = False) -> None:
    """Per element ``m = lerp(m, g, 1-b1)``, ``v = v*b2 + (1-b2)*g*g``, ``p -= (lr/c1) * m /
    (sqrt(v)/sqrt(c2) + eps)`` with ``c = 1 - b^t`` in binary64 (AdamW first ``p *= 1 -
    lr*wd``; Adam's ``weight_decay`` adds ``wd*p`` to the gradient; ``vmaxs``: AMSGrad's
    running maximum of ``v``, used in the denominator; ``maximize`` negates the gradient);
    ``t`` (the step each tensor reaches) is passed as a float32 tensor, as torch.optim
    keeps it. ``eps`` is added after the bias correction, so a tiny eps never rounds the
    denominator to 0. One call per (device, dtype, t) group."""
    kernel = torch._fused_adamw_ if adamw else torch._fused_adam_
    groups: dict[tuple, tuple[list, list, list, list, list]] = {}
    for k, (p, g, m, v, t) in enumerate(zip(ps, gs, ms, vs, steps)):
        group = groups.setdefault((p.device, p.dtype, t), ([], [], [], [], []))
        group[0].append(p), group[1].append(g), group[2].append(m), group[3].append(v)
        if vmaxs is not None:
            group[4].append(vmaxs[k])
    for (device, _, t), (pl, gl, ml, vl, xl) in groups.items():
        step = torch.full((), float(t), dtype=torch.float32, device=device)  # an upload, never a read
        kernel(pl, gl, ml, vl, xl, [step] * len(pl), lr=lr, beta1=beta1, beta2=beta2,
               weight_decay=weight_decay, eps=eps, amsgrad=vmaxs is not None, maximize=maximize)


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
    """Adam/AdamW by torch's fused kernel (``adam``); the records advance as always."""
    news = advanced(h, ss)
    adam(ps, gs, [s.m for s in ss], [s.v for s in ss], [n.step for n in news], adamw=decoupled(h), lr=lr,
         beta1=h.beta1, beta2=h.beta2, weight_decay=h.weight_decay, eps=h.eps, maximize=h.maximize,
         vmaxs=[s.vmax for s in ss] if h.amsgrad else None)
    return news


def decoupled(h) -> bool:
    return isinstance(h, AdamW) or h.decoupled_weight_decay


def advanced(h, ss: list) -> list:
    """The records one step on (the same buffers, ``t + 1``)."""
    if h.amsgrad:
        return [AMSGradState(s.step + 1, s.m, s.v, s.vmax) for s in ss]
    return [AdamState(s.step + 1, s.m, s.v, s.beta1_power * h.beta1, s.beta2_power * h.beta2) for s in ss]
