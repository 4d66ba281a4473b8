"""torch's fused optimizer kernels (``torch._fused_sgd_``, ``_fused_adagrad_``,
``_fused_adam_``, ``_fused_adamw_``: what ``torch.optim.*(fused=True)`` runs), called on
(device, dtype) groups of tensors. The kernels are elementwise, so one tensor alone gives
the same bits as in a group: the per-tensor rules call them too. Where they do not apply
(another device type or dtype) the rules keep their ``foreach`` form.
"""

from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def fusable(ps) -> bool:
    """Whether the fused kernels take these tensors (CPU or CUDA, a float dtype)."""
    for p in ps:  # a plain loop over tensor attributes: this runs every step
        if not ((p.is_cpu or p.is_cuda) and p.dtype in DTYPES):
            return False
    return True


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
