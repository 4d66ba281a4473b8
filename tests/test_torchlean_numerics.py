"""numerics="torchlean": upstream's formulas (spec §3) in upstream's order, checked bit for
bit against values computed here by hand, one rounding per written operation: Python
floats for binary64, numpy float32 scalars for binary32 (never leantrain's own code)."""

import math

import numpy as np
import pytest
import torch

import leantrain as lt
from leantrain import optim
from optimizer_table import REFERENCED, TABLE


def test_sgd_rounds_twice_as_written():
    p = lt.ParamList.of_pack([torch.tensor([2.0], dtype=torch.float64)])
    opt = optim.sgd(0.1, numerics="torchlean")
    opt.step(opt.init(p), p, [torch.tensor([1.3], dtype=torch.float64)])
    assert p.values()[0].item() == 1.87  # 2.0 - (1.3*0.1): two roundings
    fast = lt.ParamList.of_pack([torch.tensor([2.0], dtype=torch.float64)])
    optim.sgd(0.1).step(optim.sgd(0.1).init(fast), fast, [torch.tensor([1.3], dtype=torch.float64)])
    assert fast.values()[0].item() == 1.8699999999999999  # the fused fast path


def by_hand(kind, F, p, grads, lr, h):
    """The spec §3 table, scalar by scalar. ``F`` casts to the runtime scalar type."""
    sqrt = (lambda x: F(math.sqrt(x))) if F is float else np.sqrt
    one, zero = F(1.0), F(0.0)
    lr = F(lr)
    b = G = A = m = v = E = D = zero
    b1p = b2p = one
    for t, g in enumerate(grads, start=1):
        g = F(g)
        if kind == "sgd":
            p = p - g * lr
        elif kind == "momentum":
            b = b * F(h["momentum"]) + g
            p = p - b * lr
        elif kind == "adagrad":
            G = G + g * g
            p = p - (lr / (sqrt(max(G, zero)) + F(h["eps"]))) * g
        elif kind == "rmsprop":
            A = A * F(h["decay"]) + (g * g) * (one - F(h["decay"]))
            p = p - (lr / (sqrt(max(A, zero)) + F(h["eps"]))) * g
        elif kind in ("adam", "adamw"):
            b1, b2 = F(h["beta1"]), F(h["beta2"])
            b1p, b2p = b1p * b1, b2p * b2
            m = m * b1 + g * (one - b1)
            v = v * b2 + (g * g) * (one - b2)
            mhat, vhat = m * (one / (one - b1p)), v * (one / (one - b2p))
            if kind == "adamw":
                pd = p - p * (lr * F(h["weight_decay"]))
                p = pd - (lr / (sqrt(vhat) + F(h["eps"]))) * mhat
            else:
                p = p - (lr / (sqrt(max(vhat, zero)) + F(h["eps"]))) * mhat
        elif kind == "adadelta":
            rho, eps = F(h["rho"]), F(h["eps"])
            rms = lambda x: sqrt(max(x + eps, zero))  # noqa: E731
            E = E * rho + (g * g) * (one - rho)
            dx = (rms(D) / rms(E)) * g
            p = p - dx * lr
            D = D * rho + (dx * dx) * (one - rho)
    return p


# Every rule upstream has, from the shared table (its settings by name for ``by_hand``).
CASES = {name: (TABLE[name].make, TABLE[name].hyper) for name in REFERENCED}
LRS = {name: TABLE[name].opt.lr for name in REFERENCED}


UPSTREAM = {"sgd", "momentum", "adagrad", "rmsprop", "adam", "adamw", "adadelta"}


@pytest.mark.parametrize("kind", sorted(set(TABLE) - UPSTREAM))
def test_upstreams_rules_have_its_formula_and_the_others_refuse_it(kind):
    assert set(REFERENCED) == UPSTREAM
    name = TABLE[kind].kind
    with pytest.raises(lt.ConfigError, match=rf"optim.{name}: numerics='torchlean' .* upstream has no {name}"):
        TABLE[kind].make(numerics="torchlean")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["binary64", "binary32"])
@pytest.mark.parametrize("kind", list(CASES))
def test_every_rule_equals_the_spec_formula_bit_for_bit(kind, dtype):
    make, h = CASES[kind]
    gen = torch.Generator().manual_seed(5)
    p0 = torch.randn(40, dtype=torch.float64, generator=gen).to(dtype)
    grads = [torch.randn(40, dtype=torch.float64, generator=gen).to(dtype) for _ in range(8)]
    params = lt.ParamList.of_pack([p0])
    opt = make("torchlean")
    state = opt.init(params)
    for g in grads:
        state = opt.step(state, params, [g])
    ours = params.values()[0]
    F = float if dtype == torch.float64 else np.float32
    for k in range(40):
        want = by_hand(kind, F, F(p0[k].item()), [g[k].item() for g in grads], LRS[kind], h)
        got = ours[k].item()
        assert got == float(want) or (math.isnan(got) and math.isnan(float(want))), (k, got, float(want))


def test_the_fast_path_differs_in_the_last_bit_somewhere():
    """The reason the mode exists: leantrain's fused order is not upstream's."""
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(200, dtype=torch.float64, generator=gen)
    grads = [torch.randn(200, dtype=torch.float64, generator=gen) for _ in range(10)]
    out = {}
    for numerics in ("fast", "torchlean"):
        params = lt.ParamList.of_pack([p0])
        opt = optim.adam(0.01, numerics=numerics)
        state = opt.init(params)
        for g in grads:
            state = opt.step(state, params, [g])
        out[numerics] = params.values()[0]
    assert not torch.equal(out["fast"], out["torchlean"])
    torch.testing.assert_close(out["fast"], out["torchlean"], rtol=1e-12, atol=1e-14)


def test_torchlean_numerics_is_host_only_and_bound_to_the_history():
    params = lt.ParamList.of_pack([torch.zeros(3)]).to_device("cpu")
    with pytest.raises(lt.OptimizerStateError, match="no native path"):
        optim.adam(0.1, numerics="torchlean").init(params, native=True)
    state = optim.adam(0.1).init(lt.ParamList.of_pack([torch.zeros(3)]))
    with pytest.raises(lt.OptimizerStateError, match="different optimizer configuration"):
        optim.adam(0.1, numerics="torchlean").step(state, lt.ParamList.of_pack([torch.zeros(3)]), [torch.ones(3)])
    with pytest.raises(lt.ConfigError, match="numerics must be one of"):
        optim.sgd(0.1, numerics="exact")


def test_a_torchlean_run_checkpoints_and_resumes(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    r = lt.Runner.from_module(net, "mse")
    data = [(torch.randn(3), torch.randn(2)) for _ in range(4)]
    cfg = lt.TrainConfig(steps=4, optimizer=optim.adam(0.01, numerics="torchlean"), log_every=0,
                         checkpoint_path=tmp_path / "c.ckpt")
    lt.train_samples(r, cfg, data)
    ck = lt.load_checkpoint(tmp_path / "c.ckpt", lt.Runner.from_module(torch.nn.Linear(3, 2), "mse"),
                            optimizer=cfg.optimizer)
    assert ck.state.hyper.numerics == "torchlean" and ck.state.steps == 4
