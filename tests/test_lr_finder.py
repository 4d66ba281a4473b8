"""The learning-rate range test: an exponential sweep on a copy, the user's model,
optimizer state, generators and data position exactly as before, a suggestion read off
the smoothed curve, a plot, and its refusals."""

import copy

import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader, TensorDataset

import leantrain as lt
from leantrain import optim
from leantrain.lr_finder import suggest


def classifier(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.1),
                               torch.nn.Tanh(), torch.nn.Linear(16, 3))


def data(n=256):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 4, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def snapshot(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_the_sweep_leaves_model_state_generators_and_loader_exactly_as_they_were(tmp_path):
    model = classifier()
    r = lt.Runner.from_module(model, "cross_entropy").to("cpu")  # values on device mirrors too
    x, y = data()
    g = torch.Generator().manual_seed(11)
    loader = TorchLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=g)
    params = [p for p in model.parameters()]
    before, global_rng, loader_rng = snapshot(model), torch.get_rng_state(), g.get_state()
    result = lt.find_lr(r, loader, optim.adam(1e-3), steps=40, plot=tmp_path / "lr.png")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # parameters and BatchNorm's
    assert [p for p in model.parameters()] == params  # the user's Parameter objects
    assert all(torch.equal(a, before[k]) for a, (k, _) in zip(r.params.values(), model.named_parameters()))
    assert torch.equal(torch.get_rng_state(), global_rng) and torch.equal(g.get_state(), loader_rng)
    assert len(result.lrs) == 40 and result.lrs[0] == 1e-7 and result.lrs[-1] == pytest.approx(10.0)
    assert all(b / a == pytest.approx((10.0 / 1e-7) ** (1 / 39)) for a, b in zip(result.lrs, result.lrs[1:]))
    assert result.suggestion is not None and 1e-5 < result.suggestion < 10
    assert (tmp_path / "lr.png").stat().st_size > 0


def test_training_after_the_sweep_is_bit_for_bit_training_without_it():
    """The model, its optimizer's history and the data position are exactly as before: a
    run that resumes from the same checkpoint after a sweep equals one that does not."""
    x, y = data()
    runs = []
    for sweep in (False, True):
        model = classifier()
        r = lt.Runner.from_module(model, "cross_entropy")
        torch.manual_seed(2)
        loader = TorchLoader(TensorDataset(x, y), batch_size=16, shuffle=True)  # the global generator's shuffle
        opt = optim.adam(1e-2)
        state = opt.init(r.params)
        state, _ = lt.step_batch_and_loss(r, opt, state, False, [(x[:8], y[:8])])  # a history the user holds
        if sweep:
            lt.find_lr(r, loader, optim.adam(1e-3), steps=12)
        state, loss = lt.step_batch_and_loss(r, opt, state, False, [next(iter(loader))])
        runs.append((loss, [t.clone() for t in r.params.values()]))
    assert runs[0][0] == runs[1][0] and all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_the_losses_are_the_pre_update_losses_of_the_same_training_by_hand():
    model = classifier(3)
    model.eval()  # no dropout or batch statistics: the hand loop below is the same computation
    x, y = data(64)
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)]
    result = lt.find_lr(lt.Runner.from_module(model, "cross_entropy"), batches, optim.sgd(1.0), start_lr=1e-3,
                        end_lr=1.0, steps=6)
    ref = copy.deepcopy(model)
    losses = []
    for t in range(6):
        xb, yb = batches[t % 4]
        loss = torch.nn.functional.cross_entropy(ref(xb), yb)
        losses.append(loss.item())
        ref.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= result.lrs[t] * p.grad
    assert result.losses == pytest.approx(losses, rel=1e-5)


def test_a_diverging_sweep_stops_early():
    x, y = data(64)
    result = lt.find_lr(lt.Runner.from_module(classifier(), "cross_entropy"), [(x, y)], optim.sgd(1.0),
                        start_lr=1e-2, end_lr=1e6, steps=100)
    assert result.diverged and len(result.losses) < 100


def test_the_suggestion_is_the_steepest_fall_before_the_minimum():
    lrs = [10.0 ** (k / 2) for k in range(-8, 2)]
    smoothed = [2.0, 2.0, 1.99, 1.9, 1.5, 0.9, 0.7, 0.65, 0.8, 3.0]
    assert suggest(lrs, smoothed) == lrs[4] or suggest(lrs, smoothed) == lrs[5]
    assert suggest(lrs, [1.0] * 10) is None  # never fell


@pytest.mark.parametrize("kw, message", [
    (dict(start_lr=1.0, end_lr=0.1), "expected 0 < start_lr < end_lr"),
    (dict(steps=2), "steps must be an integer >= 3"),
    (dict(smoothing=0), "smoothing must be in"),
    (dict(diverge=1.0), "diverge must be a number > 1"),
    (dict(checkpoint_path="x.ckpt"), "checkpoint_path is the range test's own"),
    (dict(nonfinite="raise"), "nonfinite is the range test's own"),
    (dict(measure_loss=True), "measure_loss is the range test's own"),
    (dict(schedule_per="epoch"), "schedule_per is the range test's own"),
    (dict(lr_decay=0.1), "unknown option 'lr_decay'"),
])
def test_bad_settings_are_refused_before_anything_runs(kw, message):
    model = classifier()
    before = snapshot(model)
    with pytest.raises(lt.ConfigError, match=message):
        lt.find_lr(lt.Runner.from_module(model, "cross_entropy"), [data(16)], optim.sgd(0.1), **kw)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_model_that_cannot_be_copied_and_a_one_shot_iterator_are_refused_by_name():
    class Uncopyable(torch.nn.Linear):
        def __deepcopy__(self, memo):
            raise TypeError("cannot pickle '_thread.lock' object")

    model = Uncopyable(4, 3)
    before = snapshot(model)
    with pytest.raises(lt.ConfigError, match=r"find_lr: the model cannot be copied \(copy.deepcopy raised TypeError"):
        lt.find_lr(lt.Runner.from_module(model, "cross_entropy"), [data(16)], optim.sgd(0.1))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(lt.ConfigError, match="find_lr: data is a one-shot iterator"):
        lt.find_lr(lt.Runner.from_module(classifier(), "cross_entropy"), (b for b in [data(16)] * 5), optim.sgd(0.1))
