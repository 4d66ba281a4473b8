"""torch's own optimizer catalogue (``torch.testing._internal.common_optimizers.optim_db``):
every configuration of every optimizer leantrain ports, run by leantrain and by
``torch.optim`` on the same model, bit for bit, parameters and optimizer state; and every
input torch rejects is a ``ConfigError`` here, raised before anything changes.

The model has a tie (two layers share a weight), a frozen layer, and a branch used only on
some updates (its slots get no gradient then: neither moved nor advanced, torch's rule).
torch runs its fastest implementation: ``fused=True`` where it has a fused kernel (SGD,
Adam, AdamW, Adagrad), else ``foreach=True``, else its per-tensor loop (Muon).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import leantrain as lt
from leantrain.optim.constructors import CONSTRUCTORS, TORCH_NAMES
from leantrain.optim.porting import STATE_KEYS

common = pytest.importorskip("torch.testing._internal.common_optimizers")
DB = {info.optim_cls.__name__: info for info in common.optim_db}
FUSED = ("SGD", "Adam", "AdamW", "Adagrad")
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class Net(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4, bias=bias)
        self.frozen = nn.Linear(4, 4, bias=bias).requires_grad_(False)
        self.branch = nn.Linear(4, 4, bias=bias)
        self.b = nn.Linear(4, 4, bias=bias)
        self.b.weight = self.a.weight  # a tie

    def forward(self, x):
        h = self.frozen(torch.tanh(self.a(x)))
        if x[0, 0] > 0:  # the branch: used on some updates only
            h = h + self.branch(h)
        return self.b(h)


def loss_fn(out, y):
    return (out - y).pow(2).mean()


def cases():
    out = []
    for name in TORCH_NAMES:
        if name not in DB:  # an optimizer this torch lacks (Muon before 2.9)
            continue
        for inp in DB[name].optim_inputs_func(device="cpu", dtype=torch.float32):
            for dtype in DTYPES:
                out.append(pytest.param(name, inp.kwargs, dtype, id=f"{name}-{inp.desc}-{str(dtype)[6:]}"))
    return out


def _samples(dtype):
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 4, generator=gen) for _ in range(5)]
    for k, x in enumerate(xs):
        x[0, 0] = abs(x[0, 0]) * (1 if k % 2 == 0 else -1)  # the branch on updates 0, 2, 4
    return [(x.to(dtype), torch.randn(2, 4, generator=gen).to(dtype)) for x in xs]


@pytest.mark.parametrize("name, kwargs, dtype", cases())
def test_every_catalogue_config_gives_torchs_bits(name, kwargs, dtype):
    torch.manual_seed(1)
    model = Net(bias=name != "Muon").to(dtype)  # torch's Muon takes matrices only
    ref = copy.deepcopy(model)
    impl = {"fused": True} if name in FUSED else {} if name == "Muon" else {"foreach": True}
    if name == "SGD" and dtype in (torch.bfloat16, torch.float16):
        impl = {"foreach": False}  # torch's fused kernel leaves elements unwritten there (see classic_rules.py)
    theirs = getattr(torch.optim, name)([p for p in ref.parameters() if p.requires_grad], **kwargs, **impl)
    opt = CONSTRUCTORS[TORCH_NAMES[name]](**kwargs)
    runner = lt.Runner.from_module(model, loss_fn)
    eps = getattr(opt.hyper, "eps", None)
    if dtype == torch.float16 and not opt.hyper._fused and eps is not None and torch.tensor(eps).half() == 0:
        # a foreach form keeps sqrt(v) + eps in float16, where this eps is 0: a zero gradient
        # element would divide 0 by 0. leantrain refuses that before anything runs
        with pytest.raises(lt.ConfigError, match="eps must be finite and > 0 after conversion to float16"):
            opt.init(runner.params)
        return
    state = opt.init(runner.params)
    for x, y in _samples(dtype):
        theirs.zero_grad(set_to_none=True)
        loss_fn(ref(x), y).backward()
        theirs.step()
        state = lt.step_batch(runner, opt, state, False, [(x, y)])
    for (key, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), f"{key}: differs from torch by {(a.double() - b.double()).abs().max().item():.3g}"
    by_tensor = {id(p): i for i, p in enumerate(model.parameters())}
    for ours_p, ref_p in zip(model.parameters(), ref.parameters()):
        i = [k for k, v in enumerate(runner.params) if v.storage.host is ours_p][0]
        record, saved = state.slots[i], theirs.state.get(ref_p, {})
        if record is None:  # the frozen layer: no history on either side
            assert not ref_p.requires_grad and not saved
            continue
        if not saved:  # never had a gradient: torch made no state; ours is untouched zeros
            assert getattr(record, "step", 0) == 0 and all(not t.any() for t in record.tensors().values())
            continue
        for field, t in record.tensors().items():
            assert torch.equal(t, saved[STATE_KEYS[field]]), f"{name} slot {i}: {field} differs"
        if hasattr(record, "step") and "step" in saved:  # kept where the rule reads it (not Adagrad's, RMSprop's)
            assert record.step == int(saved["step"].item())
        for scalar in ("mu_product", "eta", "mu"):
            if hasattr(record, scalar):
                assert getattr(record, scalar) == saved[scalar].item(), scalar
    assert by_tensor  # the loop above compared every parameter


def error_cases():
    out = []
    for info in common.optim_db:
        for k, err in enumerate(info.optim_error_inputs_func(device="cpu", dtype=torch.float32)):
            out.append(pytest.param(info.optim_cls.__name__, err, id=f"{info.optim_cls.__name__}-{k}"))
    return out


@pytest.mark.parametrize("name, err", error_cases())
def test_every_input_torch_rejects_is_a_config_error(name, err):
    inp = err.optimizer_error_input
    params = inp.params
    if name not in TORCH_NAMES:
        pytest.skip(f"leantrain does not port torch.optim.{name} (see the next test)")
    if name == "Muon" and "2D" in str(err.error_regex):
        pytest.skip("leantrain's Muon gives slots that are not matrices its AdamW fallback, by design")
    before = [p.detach().clone() for p in _flat(params)]
    with pytest.raises(lt.ConfigError):
        CONSTRUCTORS[TORCH_NAMES[name]](**inp.kwargs).init(params)
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, _flat(params)))


@pytest.mark.parametrize("name", ["LBFGS", "SparseAdam"])
def test_optimizers_leantrain_does_not_port_are_refused_by_name(name):
    """LBFGS re-evaluates a closure many times per step and SparseAdam takes sparse
    gradients only: neither is an update from one gradient."""
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(lt.ConfigError, match=f"no counterpart of torch.optim.{name}"):
        lt.optim.from_torch(getattr(torch.optim, name)([p]))
    assert name.lower() not in lt.optim.OPTIMIZERS


def _flat(params):
    if isinstance(params, torch.Tensor):
        return [params]
    out = []
    for x in params if isinstance(params, (list, tuple)) else []:
        if isinstance(x, dict):
            out += _flat(list(x["params"]) if not isinstance(x["params"], torch.Tensor) else [x["params"]])
        elif isinstance(x, tuple):
            out.append(x[1])
        elif isinstance(x, torch.Tensor):
            out.append(x)
    return out
