"""Every optimizer in every dtype against the torch path the optimizers guide names for it
(``PATHS``): optimizers x dtypes x options x "first gradient late" (a parameter with no
gradient at the first update: torch skips it and starts its state late), one param group
as a user writes it, torch's ``optim.X(...)`` stepping beside leantrain's on a copy, the
bits equal after every update. And the elements-moved check: at every update, every
element torch's for-loop form moves by two ulps or more moves in leantrain too (each from
where its own run stands: the paths' roundings differ, an update's size hardly), so a kernel that leaves
elements unwritten (torch 2.13's fused SGD on CPU bfloat16/float16 writes only each
tensor's scalar tail) cannot pass for "torch's bits" again. Complex parameters: refused,
with the real view that trains as torch trains them."""

from __future__ import annotations

import warnings

import pytest
import torch

import leantrain as lt
from leantrain import optim
from leantrain.optim.constructors import CONSTRUCTORS, TORCH_NAMES

HALF = (torch.bfloat16, torch.float16)
DTYPES = (torch.float32, torch.float64, *HALF)

# The torch implementation each optimizer's bits equal on CPU, per dtype (the optimizers
# guide's table says the same): "fused" torch.optim.X(fused=True), "foreach"
# torch.optim.X(foreach=True), "for-loop" torch.optim.X(foreach=False) (torch's CPU default).
FUSED = {"sgd", "adam", "adamw", "adagrad"}


def path(kind: str, dtype: torch.dtype, late: bool = False) -> str:
    if kind == "sgd" and dtype in HALF:
        return "for-loop"  # torch's fused SGD leaves elements unwritten there
    if kind == "sgd" and late:
        return "for-loop"  # torch's fused SGD raises on a late first gradient; its for-loop has the same bits
    return "fused" if kind in FUSED else "foreach"


# kind -> option sets (torch's keyword names) beyond the defaults
OPTIONS = {
    "sgd": [{}, {"momentum": 0.9}, {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
            {"momentum": 0.9, "dampening": 0.2, "maximize": True}],
    "adam": [{}, {"amsgrad": True, "weight_decay": 0.01}, {"maximize": True}],
    "adamw": [{}, {"amsgrad": True}, {"weight_decay": 0.1, "maximize": True}],
    "adagrad": [{}, {"lr_decay": 0.01, "weight_decay": 0.01}],
    "rmsprop": [{}, {"momentum": 0.9, "centered": True}],
    "adadelta": [{}, {"weight_decay": 0.01}],
    "nadam": [{}, {"decoupled_weight_decay": True, "weight_decay": 0.01}],
    "radam": [{}, {"decoupled_weight_decay": True, "weight_decay": 0.01}],
    "adamax": [{}, {"weight_decay": 0.01}],
    "asgd": [{}, {"weight_decay": 0.01}],
    "rprop": [{}, {"maximize": True}],
    "adafactor": [{}],
}
EPS = {"adam", "adamw", "adagrad", "rmsprop", "adadelta", "nadam", "radam", "adamax"}  # eps in float16: 1e-4
CASES = [(kind, opts) for kind in sorted(OPTIONS) for opts in OPTIONS[kind]]
SHAPES = [(64, 5), (67,), (3,), (8, 8)]


def _kwargs(kind: str, opts: dict, dtype: torch.dtype) -> dict:
    kw = {"lr": 0.01, **opts}
    if dtype == torch.float16 and kind in EPS:
        kw["eps"] = 1e-4  # the default 1e-8 is 0 in float16 (refused by the foreach forms)
    return kw


def _torch(kind: str, params, kw: dict, impl: str):
    name = {v: k for k, v in TORCH_NAMES.items()}[kind]
    flag = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[impl]
    return getattr(torch.optim, name)(params, **kw, **flag)


FLAGS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}


def _run(kind: str, opts: dict, dtype: torch.dtype, late: bool, form: str = "default", steps: int = 4):
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
    kw = _kwargs(kind, opts, dtype)
    theirs = [p.clone().requires_grad_(True) for p in start]
    loop = [p.clone().requires_grad_(True) for p in start]
    ours = [p.clone() for p in start]
    named = _torch(kind, theirs, kw, path(kind, dtype, late) if form == "default" else form)
    reference = _torch(kind, loop, kw, "for-loop")
    opt = CONSTRUCTORS[kind](**kw, **({} if form == "default" else FLAGS[form]))
    state = opt.init(ours)
    moved = 0
    for step in range(steps):
        before_ours, before_loop = [p.clone() for p in ours], [p.detach().clone() for p in loop]
        grads = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
        if late and step == 0:
            grads[1] = None  # no gradient: no update, no state yet (torch.optim's rule)
        for group in (theirs, loop):
            for p, g in zip(group, grads):
                p.grad = None if g is None else g.clone()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            named.step()
            reference.step()
        state = opt.step(state, ours, [None if g is None else g.clone() for g in grads])
        for k, (a, b) in enumerate(zip(ours, theirs)):
            assert torch.equal(a, b.detach()), f"{kind} {opts} {dtype} late={late}: slot {k} after update {step + 1}"
        for k, (a0, a, b0, b) in enumerate(zip(before_ours, ours, before_loop, loop)):
            far = (b.detach().double() - b0.double()).abs() >= 2 * _ulp(b0)  # the for-loop clearly moved it
            moved += int(far.sum())
            left = far & (a == a0)
            assert not left.any(), (f"{kind} {opts} {dtype}: update {step + 1} leaves {int(left.sum())} of "
                                    f"{a.numel()} elements of slot {k} where torch's for-loop moves them")
    return moved


@pytest.mark.parametrize("form", ["default", "fused", "foreach", "for-loop"])
@pytest.mark.parametrize("late", [False, True], ids=["grads-from-start", "first-grad-late"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kind, opts", CASES, ids=[f"{k}-{'-'.join(o) or 'defaults'}" for k, o in CASES])
def test_every_optimizer_gives_its_named_torch_paths_bits_and_moves_what_torch_moves(kind, opts, dtype, late, form):
    """``default``: the path the guide names; a form by name (torch's ``fused=True``,
    ``foreach=True``, ``foreach=False``): that form's bits."""
    if form != "default" and form not in CONSTRUCTORS[kind]().hyper._forms:
        pytest.skip(f"torch has no {form} {kind}")
    if form == "fused" and kind == "sgd" and (dtype in HALF or late):
        pytest.skip("torch's fused SGD leaves elements unwritten on CPU half tensors (refused) and raises on a "
                    "late first gradient")
    moved = _run(kind, opts, dtype, late, form)
    assert moved > 0 or kind == "adadelta", "the elements-moved check saw no element move"


_MANTISSA = {torch.float32: 23, torch.float64: 52, torch.float16: 10, torch.bfloat16: 7}  # stored bits


def _ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of ``t``'s dtype at each element (as float64)."""
    e = torch.floor(torch.log2(torch.clamp(t.double().abs(), min=torch.finfo(t.dtype).tiny)))
    return torch.pow(2.0, e - _MANTISSA[t.dtype])


def test_sgd_in_half_precision_on_cpu_trains_every_element():
    """The regression itself: plain SGD on a 64-element bfloat16 tensor moved 0 of 64."""
    p = torch.randn(64, generator=torch.Generator().manual_seed(1)).bfloat16()
    before = p.clone()
    opt = optim.sgd(0.1)
    opt.step(opt.init([p]), [p], [torch.ones(64, dtype=torch.bfloat16)])
    assert bool((p != before).all())


@pytest.mark.parametrize("kind", ["adam", "adamw", "adagrad", "rmsprop", "adadelta", "nadam", "radam", "adamax",
                                  "asgd", "rprop", "sgd"])
def test_complex_parameters_are_refused_with_the_real_view_that_trains_as_torch(kind):
    """torch.optim updates a complex parameter as its real view (SGD excepted: complex
    arithmetic); leantrain refuses complex parameters (records, checkpoints and sharding
    are real-valued) and the message names the real view, which gives torch's complex bits
    (``foreach=True``; torch's fused kernels refuse complex tensors), SGD's to rounding."""
    z = torch.randn(5, dtype=torch.complex64, generator=torch.Generator().manual_seed(2))
    with pytest.raises(lt.ConfigError, match="view_as_real"):
        CONSTRUCTORS[kind](0.01).init([z.clone()])
    theirs = z.clone().requires_grad_(True)
    torch_opt = getattr(torch.optim, {v: k for k, v in TORCH_NAMES.items()}[kind])([theirs], lr=0.01, foreach=True)
    real = torch.view_as_real(z.clone()).clone()
    opt = CONSTRUCTORS[kind](0.01)
    state = opt.init([real])
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        g = torch.randn(5, dtype=torch.complex64, generator=gen)
        theirs.grad = g.clone()
        torch_opt.step()
        state = opt.step(state, [real], [torch.view_as_real(g).clone()])
    if kind == "sgd":
        torch.testing.assert_close(torch.view_as_complex(real), theirs.detach(), rtol=1e-6, atol=1e-7)
    else:
        assert torch.equal(torch.view_as_complex(real), theirs.detach())


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw", "adagrad"])
def test_off_the_fused_devices_the_default_is_torchs_foreach_form(kind, monkeypatch):
    """A device torch's fused kernels do not take (MPS before its kernels, XPU, HPU...) runs
    torch's functional foreach forms: forced on CPU through the same switch, the device
    list taken from torch, leantrain's default gives torch.optim.X(foreach=True)'s bits."""
    from leantrain.optim import kernels

    monkeypatch.setattr(kernels, "FUSED_DEVICES", frozenset())
    opts = {"sgd": {"momentum": 0.9}, "adam": {"amsgrad": True}, "adamw": {}, "adagrad": {}}[kind]
    gen = torch.Generator().manual_seed(4)
    start = [torch.randn(s, generator=gen) for s in SHAPES]
    theirs = [p.clone().requires_grad_(True) for p in start]
    ours = [p.clone() for p in start]
    torch_opt = _torch(kind, theirs, {"lr": 0.01, **opts}, "foreach")
    opt = CONSTRUCTORS[kind](0.01, **opts)
    _same_steps(torch_opt, opt, opt.init(ours), theirs, ours, 20, lambda p: torch.randn(p.shape, generator=gen))


@pytest.mark.parametrize("name, flags, kind, dtype", [
    ("SGD", {}, "for-loop", torch.bfloat16), ("AdamW", {}, "for-loop", torch.bfloat16),
    ("AdamW", {}, "for-loop", torch.float32), ("Adam", {"foreach": True}, "foreach", torch.bfloat16),
    ("SGD", {"fused": True}, "fused", torch.float32), ("RMSprop", {}, "for-loop", torch.float16),
    ("NAdam", {"foreach": True}, "foreach", torch.bfloat16), ("ASGD", {}, "for-loop", torch.float32),
])
def test_from_torch_runs_the_implementation_torch_runs(name, flags, kind, dtype):
    """A torch optimizer built as a user builds it (no flags: torch's per-tensor loop on
    CPU) continues in leantrain with the bits torch's continues with."""
    gen = torch.Generator().manual_seed(5)
    theirs = [torch.randn(s, generator=gen).to(dtype).requires_grad_(True) for s in SHAPES]
    kw = {"momentum": 0.9} if name == "SGD" else {"eps": 1e-4} if dtype == torch.float16 else {}
    torch_opt = getattr(torch.optim, name)(theirs, lr=0.01, **kw, **flags)
    for _ in range(2):
        for p in theirs:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        torch_opt.step()
    opt, state = optim.from_torch(torch_opt)  # the history copied from torch's state
    ours = [p.detach().clone() for p in theirs]
    assert opt.hyper.implementation == kind
    assert state.steps == (0 if name in ("SGD", "RMSprop") else 2)  # records that keep no step count
    _same_steps(torch_opt, opt, state, theirs, ours, 3, lambda p: torch.randn(p.shape, generator=gen).to(dtype))


@pytest.mark.parametrize("make, message", [
    (lambda: optim.rmsprop(0.01, fused=True), "runs rmsprop as 'foreach', 'for-loop'"),
    (lambda: optim.lion(1e-4, foreach=True), "none to choose"),
    (lambda: optim.adam(1e-3, foreach=False, numerics="torchlean"), "drop implementation"),
])
def test_an_implementation_torch_does_not_have_is_refused(make, message):
    with pytest.raises(lt.ConfigError, match=message):
        make()


def test_from_torch_refuses_a_target_that_is_not_the_torch_optimizers():
    """A slot the torch optimizer does not update would start from no history, silently."""
    theirs = [torch.randn(3, requires_grad=True)]
    torch_opt = torch.optim.Adam(theirs, lr=0.01)
    theirs[0].grad = torch.ones(3)
    torch_opt.step()
    with pytest.raises(lt.ConfigError, match="not a parameter of the torch optimizer"):
        optim.from_torch(torch_opt, [theirs[0].detach().clone()])


def test_fused_sgd_on_a_cpu_half_parameter_is_refused_before_anything_changes():
    p = torch.randn(8).bfloat16()
    before = p.clone()
    with pytest.raises(lt.ConfigError, match="writes only each tensor's scalar tail"):
        optim.sgd(0.1, fused=True).init([p])
    assert torch.equal(p, before)


def _same_steps(torch_opt, opt, state, theirs, ours, steps, gradient) -> None:
    """``steps`` updates of both with the same gradients (``gradient(p)`` per parameter):
    leantrain's parameters equal torch's, bit for bit."""
    for _ in range(steps):
        grads = [gradient(p) for p in theirs]
        for p, g in zip(theirs, grads):
            p.grad = g.clone()
        torch_opt.step()
        state = opt.step(state, ours, grads)
    assert all(torch.equal(a, b.detach()) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgds_default_is_torchs_fused_kernel_and_foreach_false_its_cpu_default_over_a_scalar_tail(momentum):
    """#70: the float32 default ``optim.sgd`` runs torch's fused kernel; torch's CPU default
    (``torch.optim.SGD`` with no flag) is its per-tensor loop, ``optim.sgd(foreach=False)``.
    With momentum the fused kernel rounds the scalar tail (elements past the last multiple
    of 8) otherwise than the loop: a 1,031-element slot (a tail of 7) over 16 updates,
    weight decay 1e-4, shows it; the guide says which flag gives which bits."""
    def theirs(**flags):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(1031))
        opt = torch.optim.SGD([p], lr=0.05, momentum=momentum, weight_decay=1e-4, **flags)
        for _ in range(16):
            p.grad = torch.randn(1031)
            opt.step()
        return p.detach()

    def ours(**flags):
        torch.manual_seed(0)
        params = lt.ParamList.of_pack([torch.randn(1031)])
        opt = optim.sgd(0.05, momentum=momentum, weight_decay=1e-4, **flags)
        state = opt.init(params)
        for _ in range(16):
            state = opt.step(state, params, [torch.randn(1031)])
        return params.values()[0].detach()

    fused, loop = theirs(fused=True), theirs()
    assert torch.equal(ours(), fused) and torch.equal(ours(foreach=False), loop)
    assert torch.equal(fused, loop) == (momentum == 0.0)  # the tail differs with momentum: the guide says so
