"""Muon's split in plain PyTorch: ``torch.optim.Muon`` on the 2-D parameters and
``torch.optim.AdamW(fused=True)`` on the rest, behind one optimizer's interface. It is
the torch counterpart of ``optim.muon`` (``leantrain check`` and the tests compare
against it): torch's Muon refuses anything but matrices, so a model with biases needs
both, which is what the Muon authors prescribe."""

from __future__ import annotations

from collections import ChainMap

import torch

MUON_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn")


class MuonWithAdamW:
    """One ``step()`` of both optimizers; param groups (each may set any of the keys of
    ``__init__``) are split the same way."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients=(3.4445, -4.7750, 2.0315), eps: float = 1e-7,
                 ns_steps: int = 5, adjust_lr_fn=None, adamw_betas=(0.9, 0.999), adamw_eps: float = 1e-8) -> None:
        base = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                    ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                    adamw_betas=adamw_betas, adamw_eps=adamw_eps)
        items = list(params)
        groups = items if items and isinstance(items[0], dict) else [{"params": items}]
        muon, adamw = [], []
        for g in groups:
            opts = {**base, **{k: v for k, v in g.items() if k != "params"}}
            ps = list(g["params"])
            mats, rest = [p for p in ps if p.ndim == 2], [p for p in ps if p.ndim != 2]
            if mats:
                muon.append({"params": mats, **{k: opts[k] for k in MUON_KEYS}})
            if rest:
                adamw.append({"params": rest, "lr": opts["lr"], "weight_decay": opts["weight_decay"],
                              "betas": tuple(opts["adamw_betas"]), "eps": opts["adamw_eps"]})
        self.optimizers = []
        if muon:
            self.optimizers.append(torch.optim.Muon(muon))
        if adamw:
            self.optimizers.append(torch.optim.AdamW(adamw, fused=True))

    @property
    def param_groups(self) -> list:
        """Both optimizers' groups."""
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> ChainMap:
        """Both optimizers' per-parameter state."""
        return ChainMap(*[o.state for o in self.optimizers])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``zero_grad`` of both."""
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        """One update: Muon's on the matrices, AdamW's on the rest."""
        for o in self.optimizers:
            o.step()
