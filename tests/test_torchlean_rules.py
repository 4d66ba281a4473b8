"""The upstream conformance rules (spec §4, §6): checks after rounding to binary32, the
newer schedule formulas, finite Adam with a tiny eps, frozen-only models, empty means."""

import math

import pytest
import torch

import leantrain as lt
from leantrain import optim


@pytest.mark.parametrize("make, name", [
    (lambda: optim.sgd(0.1, momentum=0.999999999), "momentum"),
    (lambda: optim.rmsprop(0.1, decay=0.999999999), "decay"),
    (lambda: optim.adadelta(1.0, rho=0.999999999), "rho"),
    (lambda: optim.adam(0.1, beta1=0.999999999), "beta1"),
    (lambda: optim.adamw(0.1, beta2=0.999999999), "beta2"),
])
def test_a_unit_that_rounds_to_one_in_binary32_is_rejected(make, name, unchanged):
    opt = make()  # fine in binary64
    opt.init(lt.ParamList.of_pack([torch.zeros(2, dtype=torch.float64)]))
    params = lt.ParamList.of_pack([torch.zeros(2)])
    with unchanged(params), pytest.raises(lt.ConfigError, match=rf"{name} must be in \[0, 1\) after conversion to float32 \(binary32\)"):
        opt.init(params)


def test_warmup_and_cosine_follow_the_newer_upstream_forms():
    # peak*((t+1)/w): the ratio first
    assert optim.warmup_cosine(1e308, 0.0, 2, 4).lr_at(1) == 1e308
    assert optim.warmup_cosine(0.1, 0.0, 3, 10).lr_at(2) == 0.1  # 0.1*(3/3), not 0.1*3/3
    assert 0.1 * 3 / 3 == 0.10000000000000002
    # min + (peak-min)*(1+cos(pi*((t-w)/d)))/2, computed by hand
    t, w, d = 5, 0, 11
    want = 0.1 + (1.0 - 0.1) * (1 + math.cos(3.141592653589793 * ((t - w) / d))) / 2
    assert optim.warmup_cosine(1.0, 0.1, 0, 11).lr_at(5) == want
    assert want != 0.1 + (1.0 - 0.1) * (1 + math.cos(3.141592653589793 * (t - w) / d)) / 2


def test_a_schedule_that_overflows_binary32_is_refused_before_training(unchanged):
    torch.manual_seed(0)
    r = lt.Runner.from_module(torch.nn.Linear(2, 1), "mse")
    cfg = lt.TrainConfig(steps=3, optimizer=optim.sgd(0.1), scheduler=optim.warmup_cosine(1e308, 0.0, 2, 4), log_every=0)
    rng = torch.get_rng_state()
    with unchanged(r.params), pytest.raises(lt.ConfigError, match="largest rate 1e\\+308 is not finite after conversion to float32"):
        lt.train_samples(r, cfg, [(torch.zeros(2), torch.zeros(1))])
    assert torch.equal(rng, torch.get_rng_state())
    r64 = lt.Runner.from_module(torch.nn.Linear(2, 1).double(), "mse")  # binary64 holds it
    lt.train_samples(r64, lt.TrainConfig(steps=1, optimizer=optim.sgd(0.0), scheduler=optim.constant(1e300),
                                          log_every=0), [(torch.zeros(2, dtype=torch.float64), torch.zeros(1, dtype=torch.float64))])


@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_adam_with_a_tiny_eps_stays_finite(kind):
    """eps=1e-45 is the smallest binary32 subnormal; eps*sqrt(1-b2^t) rounds to 0 there."""
    p0 = torch.tensor([1.0, -2.0, 0.5])
    grads = [torch.zeros(3), torch.tensor([1.0, 0.0, -1.0]), torch.zeros(3)]
    results = []
    for path in ("per-tensor", "multi-tensor"):
        params = lt.ParamList.of_pack([p0] if path == "per-tensor" else [p0, torch.zeros(2)])
        opt = getattr(optim, kind)(0.1, eps=1e-45)
        state = opt.init(params)
        for g in grads:
            state = opt.step(state, params, [g] if path == "per-tensor" else [g, torch.zeros(2)])
        results.append(params.values()[0])
    assert torch.isfinite(results[0]).all()
    assert torch.equal(results[0], results[1])  # both paths take the same form, bit for bit


def test_adam_tiny_eps_first_zero_gradient_keeps_the_value():
    params = lt.ParamList.of_pack([torch.tensor([1.0, -2.0])])
    opt = optim.adam(0.1, eps=1e-45)
    opt.step(opt.init(params), params, [torch.zeros(2)])
    assert params.values()[0].tolist() == [1.0, -2.0]


def test_a_model_whose_only_slots_are_frozen_trains_nothing_and_reports_its_loss():
    net = torch.nn.Linear(2, 1)
    net.requires_grad_(False)
    r = lt.Runner.from_module(net, "mse")
    grads = lt.mean_gradients(r, [(torch.ones(2), torch.zeros(1))])
    assert grads == [None, None]
    before = [p.clone() for p in net.parameters()]
    report = lt.train_samples(r, lt.TrainConfig(steps=2, log_every=1), [(torch.ones(2), torch.zeros(1))], log=lambda s: None)
    assert report.steps == 2 and len(report.losses) == 2
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_the_mean_loss_of_an_empty_list_is_zero():
    assert lt.Runner.from_module(torch.nn.Linear(2, 1), "mse").mean_loss([]) == 0.0
