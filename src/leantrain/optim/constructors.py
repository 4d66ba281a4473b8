"""The optimizer constructors, one per kind, taking torch.optim's keyword names as well as
leantrain's: a torch kwargs dict ports unchanged (``optim.adamw(**{"lr": 3e-4, "betas":
(0.9, 0.95), "weight_decay": 0.1, "fused": True})``). Every argument is checked at
construction; anything leantrain does not run is a ``ConfigError`` naming the argument
and the optimizer: an unknown keyword, ``capturable=True``, ``differentiable=True``.

``fused=True``, ``foreach=True`` and ``foreach=False`` choose torch's implementation by name
(``Hyper.implementation``: "fused", "foreach", "for-loop"), whose bits the update then has;
without them leantrain runs the implementation the optimizers guide's table names (the
fused kernel where torch has a sound one, else foreach).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import ConfigError
from .hyper import SGD, Adadelta, Adagrad, Adam, AdamW, Lion, RMSProp
from .hyper_torch import ASGD, Adafactor, Adamax, Muon, NAdam, RAdam, Rprop
from .optimizer import Optimizer


def _number(op: str, name: str, value: object) -> object:
    """A 1-element tensor as its number (torch takes ``lr=torch.tensor(1e-3)``)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(f"{op}: {name} as a tensor must have 1 element, got shape {tuple(value.shape)}")
        return value.item()  # a construction-time read of the user's own tensor
    return value


def _implementation(op: str, given: dict):
    """torch's implementation switches: ``fused=True``, ``foreach=True`` or ``foreach=False``
    choose the implementation by name (``None``/``fused=False``: leantrain's choice);
    ``capturable``/``differentiable`` only off; anything else is unknown."""
    for name, value in given.items():
        if name in ("foreach", "fused"):
            if value is not None and not isinstance(value, bool):
                raise ConfigError(f"{op}: {name} must be True, False or None, got {value!r}")
        elif name in ("capturable", "differentiable"):
            if value is not False:
                why = ("leantrain keeps step counters on the host; CUDA graph capture is not supported"
                       if name == "capturable" else "leantrain's updates are not part of the autograd graph")
                raise ConfigError(f"{op}: {name}={value!r} is not supported ({why}); leave it False")
        else:
            raise ConfigError(f"{op}: unknown argument {name!r}")
    if given.get("foreach") is True and given.get("fused") is True:
        raise ConfigError(f"{op}: foreach=True and fused=True cannot both be set (as in torch.optim)")
    if given.get("fused") is True:
        return "fused"
    return {True: "foreach", False: "for-loop"}.get(given.get("foreach"))


def _pair(op: str, name: str, pair: object, first: object, second: object) -> tuple:
    """``betas=(b1, b2)`` (or a pair passed where ``beta1`` goes) as two numbers."""
    if pair is None:
        return first, second
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
        raise ConfigError(f"{op}: {name} must be a pair of numbers, got {pair!r}")
    if any(isinstance(b, torch.Tensor) for b in pair):
        raise ConfigError(f"{op}: {name} must be numbers, got {pair!r} (tensor betas exist in torch only for "
                          f"capturable updates)")
    return pair[0], pair[1]


def _make(kind: type, op: str, lr: object, fields: dict, extra: dict) -> Optimizer:
    torch_only = {k: extra.pop(k) for k in list(extra) if k in ("foreach", "fused", "capturable", "differentiable")}
    if extra:
        raise ConfigError(f"{op}: unknown argument {sorted(extra)[0]!r} (it takes {_names(kind)})")
    form = _implementation(op, torch_only)
    if isinstance(lr, torch.Tensor) and torch_only.get("foreach") is True and kind in (Adam, AdamW):
        raise ConfigError(f"{op}: lr as a tensor is not supported with foreach=True (as in torch.optim)")
    if form is not None:
        fields = {**fields, "implementation": form}
    return Optimizer(kind(_number(op, "lr", lr), **fields))


def _names(kind: type) -> str:
    import inspect
    names = [n for n, p in inspect.signature(CONSTRUCTORS[kind.kind]).parameters.items() if p.kind != p.VAR_KEYWORD]
    return ", ".join(names + ["foreach", "fused"])


def sgd(lr=1e-3, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
        nesterov: bool = False, *, maximize: bool = False, numerics: str = "fast", **torch_args) -> Optimizer:
    """SGD (``torch.optim.SGD``'s arguments): ``p -= lr * g``; with ``momentum`` heavy-ball
    ``b = momentum*b + (1-dampening)*g`` (the first step ``b = g``), ``nesterov``
    ``g + momentum*b``; ``weight_decay`` adds ``wd*p`` to the gradient; ``maximize``
    ascends. Runs torch's fused kernel: the bits of ``torch.optim.SGD(fused=True)``."""
    return _make(SGD, "optim.sgd", lr, dict(momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                            nesterov=nesterov, maximize=maximize, numerics=numerics), torch_args)


def adagrad(lr=1e-2, eps: float = 1e-10, *, lr_decay: float = 0.0, weight_decay: float = 0.0,
            initial_accumulator_value: float = 0.0, maximize: bool = False, numerics: str = "fast",
            **torch_args) -> Optimizer:
    """Adagrad: ``s += g*g; p -= clr * g / (sqrt(s) + eps)``, ``clr = lr / (1 + (t-1)*lr_decay)``
    (torch's fused kernel; sparse gradients too, except with ``weight_decay``)."""
    return _make(Adagrad, "optim.adagrad", lr, dict(eps=eps, lr_decay=lr_decay, weight_decay=weight_decay,
                                                    initial_accumulator_value=initial_accumulator_value,
                                                    maximize=maximize, numerics=numerics), torch_args)


def rmsprop(lr=1e-2, decay: Optional[float] = None, eps: float = 1e-8, *, alpha: Optional[float] = None,
            weight_decay: float = 0.0, momentum: float = 0.0, centered: bool = False, maximize: bool = False,
            numerics: str = "fast", **torch_args) -> Optimizer:
    """RMSprop: ``s = decay*s + (1-decay)*g*g; p -= lr * g / (sqrt(s) + eps)``; ``decay`` is
    torch's ``alpha`` (either name, default 0.99); ``centered`` subtracts the squared mean
    gradient, ``momentum`` keeps a buffer of the scaled steps (torch's foreach form)."""
    op = "optim.rmsprop"
    if decay is not None and alpha is not None and decay != alpha:
        raise ConfigError(f"{op}: decay={decay!r} and alpha={alpha!r} name the same setting; give one")
    rate = 0.99 if decay is None and alpha is None else (decay if decay is not None else alpha)
    return _make(RMSProp, op, lr, dict(decay=rate, eps=eps, weight_decay=weight_decay, momentum=momentum,
                                      centered=centered, maximize=maximize, numerics=numerics), torch_args)


def adam(lr=1e-3, beta1=0.9, beta2: float = 0.999, eps: float = 1e-8, *, betas=None, weight_decay: float = 0.0,
         amsgrad: bool = False, maximize: bool = False, decoupled_weight_decay: bool = False,
         numerics: str = "fast", **torch_args) -> Optimizer:
    """Adam (torch's fused kernel, bit for bit ``torch.optim.Adam(fused=True)``); ``betas=(b1,
    b2)`` or ``beta1``/``beta2``; ``weight_decay`` is L2 (added to the gradient) unless
    ``decoupled_weight_decay`` (then AdamW's); ``amsgrad`` keeps the maximum second moment."""
    op = "optim.adam"
    if isinstance(beta1, (tuple, list)):
        beta1, betas = 0.9, beta1
    b1, b2 = _pair(op, "betas", betas, beta1, beta2)
    return _make(Adam, op, lr, dict(beta1=b1, beta2=b2, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                                    maximize=maximize, decoupled_weight_decay=decoupled_weight_decay,
                                    numerics=numerics), torch_args)


def adamw(lr=1e-3, weight_decay: float = 0.01, beta1=0.9, beta2: float = 0.999, eps: float = 1e-8, *,
          betas=None, amsgrad: bool = False, maximize: bool = False, decoupled_weight_decay: bool = True,
          numerics: str = "fast", **torch_args) -> Optimizer:
    """AdamW: Adam with decoupled weight decay, ``p *= 1 - lr*weight_decay`` before the step
    (torch's fused kernel, bit for bit ``torch.optim.AdamW(fused=True)``)."""
    op = "optim.adamw"
    if decoupled_weight_decay is not True:
        raise ConfigError(f"{op}: decoupled_weight_decay={decoupled_weight_decay!r}: AdamW's decay is decoupled; "
                          f"for an L2 penalty use optim.adam(weight_decay=...)")
    if isinstance(beta1, (tuple, list)):
        beta1, betas = 0.9, beta1
    b1, b2 = _pair(op, "betas", betas, beta1, beta2)
    return _make(AdamW, op, lr, dict(weight_decay=weight_decay, beta1=b1, beta2=b2, eps=eps, amsgrad=amsgrad,
                                     maximize=maximize, numerics=numerics), torch_args)


def adadelta(lr=1.0, rho: float = 0.9, eps: float = 1e-6, *, weight_decay: float = 0.0, maximize: bool = False,
             numerics: str = "fast", **torch_args) -> Optimizer:
    """Adadelta (torch's foreach form); ``lr`` scales the update (1.0 is the original method)."""
    return _make(Adadelta, "optim.adadelta", lr, dict(rho=rho, eps=eps, weight_decay=weight_decay,
                                                      maximize=maximize, numerics=numerics), torch_args)


def lion(lr=1e-4, beta1=0.9, beta2: float = 0.99, weight_decay: float = 0.0, *, betas=None,
         numerics: str = "fast", **torch_args) -> Optimizer:
    """Lion: ``p -= lr * sign(lerp(m, g, 1-beta1))`` after ``p *= 1 - lr*weight_decay``,
    then ``m = lerp(m, g, 1-beta2)`` (see ``optim/lion_rule.py``). Use a learning rate 3-10x
    smaller than AdamW's. Upstream has no Lion: ``numerics="torchlean"`` is refused."""
    op = "optim.lion"
    if isinstance(beta1, (tuple, list)):
        beta1, betas = 0.9, beta1
    b1, b2 = _pair(op, "betas", betas, beta1, beta2)
    return _make(Lion, op, lr, dict(beta1=b1, beta2=b2, weight_decay=weight_decay, numerics=numerics), torch_args)


def nadam(lr=2e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
          momentum_decay: float = 4e-3, decoupled_weight_decay: bool = False, *, maximize: bool = False,
          numerics: str = "fast", **torch_args) -> Optimizer:
    """NAdam (torch's foreach form, bit for bit ``torch.optim.NAdam(foreach=True)``)."""
    b1, b2 = _pair("optim.nadam", "betas", betas, None, None)
    return _make(NAdam, "optim.nadam", lr, dict(beta1=b1, beta2=b2, eps=eps, weight_decay=weight_decay,
                                                momentum_decay=momentum_decay, maximize=maximize,
                                                decoupled_weight_decay=decoupled_weight_decay,
                                                numerics=numerics), torch_args)


def radam(lr=1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
          decoupled_weight_decay: bool = False, *, maximize: bool = False, numerics: str = "fast",
          **torch_args) -> Optimizer:
    """RAdam (torch's foreach form, bit for bit ``torch.optim.RAdam(foreach=True)``)."""
    b1, b2 = _pair("optim.radam", "betas", betas, None, None)
    return _make(RAdam, "optim.radam", lr, dict(beta1=b1, beta2=b2, eps=eps, weight_decay=weight_decay,
                                                decoupled_weight_decay=decoupled_weight_decay, maximize=maximize,
                                                numerics=numerics), torch_args)


def adamax(lr=2e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0, *, maximize: bool = False,
           numerics: str = "fast", **torch_args) -> Optimizer:
    """Adamax (torch's foreach form, bit for bit ``torch.optim.Adamax(foreach=True)``)."""
    b1, b2 = _pair("optim.adamax", "betas", betas, None, None)
    return _make(Adamax, "optim.adamax", lr, dict(beta1=b1, beta2=b2, eps=eps, weight_decay=weight_decay,
                                                  maximize=maximize, numerics=numerics), torch_args)


def asgd(lr=1e-2, lambd: float = 1e-4, alpha: float = 0.75, t0: float = 1e6, weight_decay: float = 0.0, *,
         maximize: bool = False, numerics: str = "fast", **torch_args) -> Optimizer:
    """Averaged SGD (torch's foreach form, bit for bit ``torch.optim.ASGD(foreach=True)``);
    the average is kept in the state as ``ax``."""
    return _make(ASGD, "optim.asgd", lr, dict(lambd=lambd, alpha=alpha, t0=t0, weight_decay=weight_decay,
                                              maximize=maximize, numerics=numerics), torch_args)


def rprop(lr=1e-2, etas=(0.5, 1.2), step_sizes=(1e-6, 50.0), *, maximize: bool = False, numerics: str = "fast",
          **torch_args) -> Optimizer:
    """Rprop (torch's foreach form, bit for bit ``torch.optim.Rprop(foreach=True)``): each
    element's step size starts at the first step's rate and adapts to the gradient's sign
    (the rate is not read after the first step, as in torch)."""
    op = "optim.rprop"
    lo, hi = _pair(op, "etas", etas, None, None)
    smin, smax = _pair(op, "step_sizes", step_sizes, None, None)
    return _make(Rprop, op, lr, dict(etaminus=lo, etaplus=hi, step_size_min=smin, step_size_max=smax,
                                     maximize=maximize, numerics=numerics), torch_args)


def adafactor(lr=1e-2, beta2_decay: float = -0.8, eps=(None, 1e-3), d: float = 1.0, weight_decay: float = 0.0, *,
              foreach=None, maximize: bool = False, numerics: str = "fast", **torch_args) -> Optimizer:
    """Adafactor (torch's foreach form, bit for bit ``torch.optim.Adafactor(foreach=True)``):
    ``eps=(eps1, eps2)`` as torch's (``eps1=None``: the dtype's machine epsilon). Its
    factored state is a row and a column per matrix: sharding that cuts a slot is refused."""
    op = "optim.adafactor"
    if not hasattr(torch.optim, "Adafactor"):
        raise ConfigError(f"{op}: this torch ({torch.__version__}) has no torch.optim.Adafactor, whose form "
                          f"leantrain runs; install torch >= 2.5")
    e1, e2 = _pair(op, "eps", eps, None, None)
    return _make(Adafactor, op, lr, dict(beta2_decay=beta2_decay, eps1=e1, eps2=e2, d=d, weight_decay=weight_decay,
                                         maximize=maximize, numerics=numerics), dict(torch_args, foreach=foreach))


def muon(lr=1e-3, weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True,
         ns_coefficients=(3.4445, -4.7750, 2.0315), eps: float = 1e-7, ns_steps: int = 5,
         adjust_lr_fn: Optional[str] = None, *, adamw_betas=(0.9, 0.999), adamw_eps: float = 1e-8,
         numerics: str = "fast", **torch_args) -> Optimizer:
    """Muon (torch.optim.Muon's form) on every 2-D slot; AdamW (torch's fused kernel, with
    ``adamw_betas``, ``adamw_eps``, the same rate and decay) on every other slot, the split
    the Muon authors prescribe. Exclude a matrix from Muon, or give the fallback its own
    rate, with ``per_slot`` (``lr_scale``, ``weight_decay``)."""
    op = "optim.muon"
    if not hasattr(torch.optim, "Muon"):
        raise ConfigError(f"{op}: this torch ({torch.__version__}) has no torch.optim.Muon, whose form leantrain "
                          f"runs; install torch >= 2.9")
    if not (isinstance(ns_coefficients, (tuple, list)) and len(ns_coefficients) == 3):
        raise ConfigError(f"{op}: ns_coefficients must be three numbers (a, b, c), got {ns_coefficients!r}")
    b1, b2 = _pair(op, "adamw_betas", adamw_betas, None, None)
    a, b, c = ns_coefficients
    return _make(Muon, op, lr, dict(weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_a=a,
                                    ns_b=b, ns_c=c, eps=eps, ns_steps=ns_steps,
                                    adjust_lr_fn="original" if adjust_lr_fn is None else adjust_lr_fn,
                                    adamw_beta1=b1, adamw_beta2=b2, adamw_eps=adamw_eps, numerics=numerics,
                                    tensor_lr=isinstance(lr, torch.Tensor)),
                 torch_args)


def _derived():
    """The constructors by kind and torch.optim's class names, from the records' own
    declarations (``Hyper.kind``, ``Hyper.torch_name``): one constructor per registered kind."""
    from .rules import HYPERS

    missing = [kind for kind in HYPERS if not callable(globals().get(kind))]
    if missing:
        raise ImportError(f"leantrain.optim: no constructor for the kinds {missing} (constructors.py)")
    return ({kind: globals()[kind] for kind in HYPERS},
            {h.torch_name: kind for kind, h in HYPERS.items() if h.torch_name is not None})


CONSTRUCTORS, TORCH_NAMES = _derived()  # kind -> constructor; torch.optim class name -> kind
