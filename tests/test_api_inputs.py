"""Inputs the hostile review found raising untyped errors (or none): losses that are not
a floating-point tensor autograd built, samples that can be read only once, one-shot
loaders, and packs of tensors without data. Each is a LeantrainError raised before
anything changes: parameters, mirrors, buffers, the iterator itself."""

import pytest
import torch
import torch.nn as nn

import leantrain as lt
from leantrain import Param, ParamList, optim
from models import TiedNet, regression_batches

BAD_LOSSES = {
    "an int tensor": (lambda y, t: ((y - t) ** 2).sum().long(), "floating-point"),
    "a bool tensor": (lambda y, t: ((y - t) ** 2).sum() > 0, "floating-point"),
    "a Python float": (lambda y, t: float(((y - t) ** 2).sum()), "got float"),
    "a detached tensor": (lambda y, t: ((y - t) ** 2).sum().detach(), "carries no gradient"),
    "computed under no_grad": (lambda y, t: _no_grad(((y - t) ** 2).sum), "carries no gradient"),
    "a fresh constant": (lambda y, t: torch.tensor(1.0), "carries no gradient"),
}


def _no_grad(f):
    with torch.no_grad():
        return f() * 1.0


def buffers(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("case", sorted(BAD_LOSSES))
@pytest.mark.parametrize("loop", ["samples", "loader"])
def test_a_loss_autograd_did_not_build_is_refused(case, loop, unchanged):
    loss, match = BAD_LOSSES[case]
    torch.manual_seed(0)
    model = TiedNet(bn=True)
    r = lt.Runner.from_module(model, loss)
    data = regression_batches(4, 3)
    before, rng = buffers(model), torch.get_rng_state()
    with unchanged(r.params), pytest.raises(lt.ConfigError, match=match):
        if loop == "samples":
            lt.train_samples(r, lt.TrainConfig(steps=2, batch_size=2, log_every=0, measure_loss=False), data)
        else:
            lt.train_loader(r, lt.LoaderTrainConfig(epochs=1, log_every=0, measure_loss=False), [data[:2], data[2:]])
    after = buffers(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.out.weight is model.mid.weight


@pytest.mark.parametrize("case", ["an int tensor", "a detached tensor"])
def test_the_vectorised_path_refuses_them_too(case, unchanged):
    model = nn.Linear(3, 2)
    r = lt.Runner.from_module(model, BAD_LOSSES[case][0])
    data = [(torch.randn(3), torch.randn(2)) for _ in range(4)]
    cfg = lt.TrainConfig(steps=1, batch_size=4, accumulation="vectorized", log_every=0, measure_loss=False)
    with unchanged(r.params), pytest.raises(lt.ConfigError, match="Runner.loss"):
        lt.train_samples(r, cfg, data)


def test_a_frozen_only_model_still_trains_to_nothing():
    model = nn.Linear(2, 1).requires_grad_(False)
    r = lt.Runner.from_module(model, "mse")
    report = lt.train_samples(r, lt.TrainConfig(steps=2, batch_size=1, log_every=0), [(torch.ones(2), torch.ones(1))])
    assert report.steps == 2


@pytest.mark.parametrize("make", [
    lambda d: (s for s in d), lambda d: iter(d), lambda d: map(lambda s: s, d), lambda d: {0: d[0]}, lambda d: "xy",
])
def test_samples_that_are_not_a_list(make, unchanged):
    data = [(torch.ones(2), torch.ones(1))] * 4
    r = lt.Runner.from_module(nn.Linear(2, 1), "mse")
    with unchanged(r.params), pytest.raises(lt.DataError, match="expected a list of \\(x, y\\) samples"):
        lt.train_samples(r, lt.TrainConfig(steps=1, batch_size=2), make(data))


@pytest.mark.parametrize("make", [lambda b: iter(b), lambda b: (x for x in b), lambda b: map(lambda x: x, b)])
def test_a_one_shot_loader_trains_once_and_is_refused_for_more_epochs(make, unchanged):
    """Read lazily, a stream that can be read once trains to its end (epochs=1, no
    measuring pass consumes it); more epochs are refused before it is consumed."""
    data = [(torch.ones(2), torch.ones(1))] * 4
    batches = [data[:2], data[2:]]
    it = make(batches)
    r = lt.Runner.from_module(nn.Linear(2, 1), "mse")
    with unchanged(r.params), pytest.raises(lt.DataError, match="one-shot iterator.*epochs=2"):
        lt.train_loader(r, lt.LoaderTrainConfig(epochs=2), it)
    assert next(it) is batches[0]  # not consumed
    report, _ = lt.train_loader(r, lt.LoaderTrainConfig(epochs=1, log_every=0), make(batches))
    assert report.steps == 2 and report.before is None and report.after is None


def native_params():
    p = Param(torch.tensor([1.0, -2.0, 3.0]), name="w")
    params = ParamList([p, Param(torch.tensor([0.5, 0.25]), name="b")])
    params.to_device("cpu")
    opt = optim.adam(0.1)
    opt.step_native(opt.init(params, native=True), params, [torch.ones(3), torch.ones(2)])
    return params


@pytest.mark.parametrize("bad", [
    lambda: torch.empty(2, device="meta"),
    lambda: torch.zeros(2).to_sparse(),
    lambda: torch.zeros(1, 2).to_sparse_csr(),
    lambda: torch.quantize_per_tensor(torch.zeros(2), 0.1, 0, torch.quint8),
])
def test_set_values_refuses_tensors_without_dense_data_before_writing(bad, unchanged):
    params = native_params()  # the trained values live in the mirrors; the hosts are stale
    trained = [s.mirror.clone() for s in params.storages()]
    with unchanged(params), pytest.raises(lt.PackError, match="slot 1 \\('b'\\): expected a dense tensor"):
        params.set_values([torch.zeros(3), bad()])
    assert all(s.mirror is not None and torch.equal(s.mirror, t) for s, t in zip(params.storages(), trained))


def test_meta_and_sparse_gradients_are_refused_by_a_step(unchanged):
    """Meta tensors hold no data; sparse gradients are for the rules that take them
    (SGD, Adagrad), not Adam."""
    params = native_params()
    opt = optim.adam(0.1)
    state = opt.init(params, native=True)
    with unchanged(params, state), pytest.raises(lt.PackError, match=r"got a sparse gradient, which adam does not take"):
        opt.step_native(state, params, [torch.ones(3), torch.ones(2).to_sparse()])
    with unchanged(params, state), pytest.raises(lt.PackError, match="meta tensor"):
        opt.step_native(state, params, [torch.empty(3, device="meta"), torch.ones(2)])
