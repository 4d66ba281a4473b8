"""``EarlyStopping`` with Lightning's options (#70): ``patience=0``, ``stopping_threshold``,
``divergence_threshold``, ``check_finite`` (a NaN or inf monitor stops at the first check,
where it ran all its evaluations), and ``monitor="train_loss"`` without an evaluation set.
The check order is Lightning's documented one: not finite, then the stopping threshold,
then the divergence threshold, then patience."""

import math

import pytest
import torch

import leantrain as lt


def stops_at(cb: lt.EarlyStopping, values) -> int:
    """The 1-based check at which ``cb`` stops over ``values`` (0: never)."""
    for k, v in enumerate(values, 1):
        if cb.on_eval(k, {"loss": v}):
            return k
    return 0


@pytest.mark.parametrize("kwargs, values, at, why", [
    (dict(patience=0), [3.0, 2.0, 2.5, 1.0], 3, "did not improve for 1"),
    (dict(patience=2), [3.0, 2.0, 2.5, 2.1, 1.0], 4, "did not improve for 2"),
    (dict(patience=5, stopping_threshold=1.5), [3.0, 2.0, 1.4, 1.0], 3, "reached stopping_threshold=1.5"),
    (dict(patience=5, divergence_threshold=10.0), [3.0, 2.0, 11.0], 3, "diverged past divergence_threshold=10.0"),
    (dict(patience=5), [3.0, float("nan"), 1.0], 2, "is not finite"),
    (dict(patience=5), [3.0, float("inf")], 2, "is not finite"),
    (dict(patience=5, check_finite=False), [3.0, float("nan"), 1.0], 0, None),
    (dict(mode="max", patience=1, stopping_threshold=0.9), [0.5, 0.95], 2, "reached stopping_threshold=0.9"),
    (dict(mode="max", patience=9, divergence_threshold=0.1), [0.5, 0.05], 2, "diverged"),
    (dict(patience=1, stopping_threshold=1.0, divergence_threshold=5.0), [2.0, 2.0], 2, "did not improve"),
])
def test_each_option_stops_where_it_says(kwargs, values, at, why):
    cb = lt.EarlyStopping(**kwargs)
    assert stops_at(cb, values) == at
    if why is not None:
        assert why in cb.reason and cb.stopped_step == at


@pytest.mark.parametrize("bad, message", [
    (dict(patience=-1), "patience"),
    (dict(stopping_threshold=float("nan")), "stopping_threshold must be a finite number"),
    (dict(divergence_threshold="big"), "divergence_threshold must be a finite number"),
    (dict(check_finite=1), "check_finite must be True or False"),
])
def test_bad_options_are_refused(bad, message):
    with pytest.raises(lt.ConfigError, match=message):
        lt.EarlyStopping(**bad)


def data(n=32):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(3, generator=g), torch.randn(1, generator=g)) for _ in range(n)]


def test_a_nan_evaluation_stops_at_the_first_check_in_a_loop():
    """Where every evaluation was run before: a model whose evaluation loss is NaN stops
    at the first one (Lightning's ``check_finite``)."""
    runner = lt.Runner.from_module(torch.nn.Linear(3, 1), "mse")
    nan_set = [(torch.randn(3), torch.tensor([float("nan")]))]
    cfg = lt.TrainConfig(steps=20, batch_size=2, eval_data=nan_set, eval_every=2, log_every=0)
    report = lt.train_samples(runner, cfg, data(), log=None, callbacks=[lt.EarlyStopping(patience=5)])
    assert report.steps == 2 and report.interrupted and math.isnan(report.evals[0][1]["loss"])


def test_the_training_loss_is_watched_without_an_evaluation_set():
    """``monitor="train_loss"``: each logged update's loss (no evaluation set needed); a
    rate that makes the loss grow stops the run by the divergence threshold; without log
    lines there is nothing to watch, refused before training."""
    torch.manual_seed(0)
    runner = lt.Runner.from_module(torch.nn.Linear(3, 1), "mse")
    seen = []
    stopper = lt.EarlyStopping("train_loss", patience=50, divergence_threshold=1e6)
    cfg = lt.TrainConfig(steps=200, batch_size=4, optimizer=lt.optim.sgd(5.0), log_every=1)
    report = lt.train_samples(runner, cfg, data(), log=None, callbacks=[stopper],
                              callback=lambda e: seen.append(e.loss))
    assert report.interrupted and report.steps == stopper.stopped_step < 200
    assert seen[-1] > 1e6 and all(v <= 1e6 for v in seen[:-1])  # the first logged loss past the threshold
    with pytest.raises(lt.ConfigError, match="monitors 'train_loss', the loss of each logged update: set log_every"):
        lt.train_samples(runner, lt.TrainConfig(steps=2, log_every=0), data(), log=None,
                         callbacks=[lt.EarlyStopping("train_loss")])
    with pytest.raises(lt.ConfigError, match="or monitor='train_loss'"):
        lt.train_samples(runner, lt.TrainConfig(steps=2), data(), log=None, callbacks=[lt.EarlyStopping()])
