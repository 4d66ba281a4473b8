"""Bad input to the loops and their configs (``TrainConfig``, ``LoaderTrainConfig``,
``train_samples``, ``train_loader``, ``step_batch``, ``DataLoader``, ``Runner``): one table,
then losses autograd did not build, samples read once and one-shot loaders."""

import warnings

import pytest
import torch
from torch import nn

import leantrain as lt
from leantrain import optim
from inputs_table import check_row, ids, sample
from models import TiedNet, regression_batches

LOOPS = [
    ("steps < 0", lambda c: lt.TrainConfig(steps=-1), lt.ConfigError, "steps must be an integer >= 0"),
    ("batch size 0", lambda c: lt.TrainConfig(steps=1, batch_size=0), lt.ConfigError, "batch_size must be an integer >= 1"),
    ("torch optimizer", lambda c: lt.TrainConfig(steps=1, optimizer=torch.optim.Adam), lt.ConfigError, "optimizer must be built with leantrain.optim"),
    ("checkpoint_every without path", lambda c: lt.TrainConfig(steps=1, checkpoint_every=5), lt.ConfigError, "needs a checkpoint_path"),
    ("nonfinite mode", lambda c: lt.TrainConfig(steps=1, nonfinite="ignore"), lt.ConfigError, "nonfinite must be one of"),
    ("epochs not finite", lambda c: lt.LoaderTrainConfig(epochs=float("inf")), lt.ConfigError,
     "epochs must be an integer >= 0"),  # a finite float is Trainer's fractional epochs since #70
    ("empty samples", lambda c: lt.train_samples(c.runner, lt.TrainConfig(steps=2), []), lt.DataError, "empty sample list"),
    ("sample not a pair", lambda c: lt.train_samples(c.runner, lt.TrainConfig(steps=2), [sample(), (torch.zeros(3),)]), lt.DataError, r"item 1: expected an \(x, y\) pair"),
    ("sample wrong shape", lambda c: lt.step_batch(c.runner, c.opt, c.rstate, False, [sample(), sample(d=5)]), lt.DataError, r"rejected the sample \(x \(5, 5\)"),
    ("sample wrong dtype", lambda c: lt.step_batch(c.runner, c.opt, c.rstate, False, [sample(), sample(dtype=torch.float64)]), lt.DataError, "rejected the sample"),
    ("empty batch", lambda c: lt.step_batch(c.runner, c.opt, c.rstate, False, []), lt.DataError, "step_batch: empty batch"),
    ("vectorized with BatchNorm", lambda c: lt.step_batch(c.runner, c.opt, c.rstate, False, [sample(), sample()], accumulation="vectorized"), lt.ConfigError, "couples the items"),
    ("loader batch 0", lambda c: lt.DataLoader(lt.Dataset([sample()]), batch_size=0), lt.ConfigError, "batch_size must be an integer >= 1"),
    ("loader seed < 0", lambda c: lt.DataLoader(lt.Dataset([sample()]), batch_size=1, seed=-3), lt.ConfigError, "seed must be an integer >= 0"),
    ("loader empty", lambda c: lt.train_loader(c.runner, lt.LoaderTrainConfig(epochs=1), lt.DataLoader(lt.Dataset([]), batch_size=1)), lt.DataError, "empty dataset"),
    ("loader rank alone", lambda c: lt.DataLoader([sample()], batch_size=2, rank=0), lt.ConfigError, "give rank and world_size together"),
    ("loader rank >= world", lambda c: lt.DataLoader([sample()], batch_size=2, rank=2, world_size=2), lt.ConfigError, "rank must be < world_size, got rank=2"),
    ("loader batch not shared", lambda c: lt.DataLoader([sample()], batch_size=3, rank=0, world_size=2), lt.ConfigError, "must be a multiple of world_size, got batch_size=3"),
    ("loader for a world not running", lambda c: lt.train_loader(c.runner, lt.LoaderTrainConfig(epochs=1), lt.DataLoader([sample(), sample()], batch_size=2, rank=0, world_size=2)), lt.ConfigError, r"made for rank 0 of 2, but this process is rank 0 of 1"),
    ("unknown loss", lambda c: lt.Runner.from_module(nn.Linear(1, 1), "hinge"), lt.ConfigError, "unknown loss 'hinge'"),
    # one epoch, a schedule by epoch: its index would stay 0 (the warm-up's first rate for the whole run)
    ("epoch schedule over one epoch", lambda c: lt.LoaderTrainConfig(epochs=1, scheduler=optim.warmup_cosine(0.1, 0.0, 10, 100)),
     lt.ConfigError, r"schedule_per='epoch' with epochs=1: .* stays 0 .* set schedule_per='step'"),
]


@pytest.mark.parametrize("name, call, error, pattern", LOOPS, ids=ids(LOOPS))
def test_loops_rejects_and_changes_nothing(name, call, error, pattern, tmp_path):
    check_row(call, error, pattern, tmp_path)


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


def test_an_epoch_schedule_over_a_loader_without_length_says_it_may_never_advance():
    """An endless stream (no length), epochs=None and a schedule by epoch: the loop warns
    that the schedule advances only when a pass ends; constant and per-update schedules do
    not warn."""
    r = lt.Runner.from_module(nn.Linear(3, 2), "mse")

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            while True:
                yield torch.randn(3), torch.randn(2)

    def go(**kw):
        loader = torch.utils.data.DataLoader(Stream(), batch_size=2)
        cfg = lt.LoaderTrainConfig(epochs=None, max_steps=2, log_every=0, measure_loss=False, **kw)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            lt.train_loader(r, cfg, loader)
        return [str(w.message) for w in said if "schedule_per" in str(w.message)]

    assert len(go(scheduler=optim.warmup_cosine(0.1, 0.0, 10, 100))) == 1
    assert go(scheduler=optim.constant(0.1)) == [] and go(scheduler=optim.warmup_cosine(0.1, 0.0, 10, 100),
                                                         schedule_per="step") == []
