"""Evaluation on a cadence in updates in both loops, named evaluation sets, ``predict``,
seeds and deterministic mode, and the loop-start checks of run management (#38)."""

import json
import warnings

import numpy
import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader, TensorDataset

import leantrain as lt
from test_evaluation_callbacks import class_data, classifier
from leantrain import optim


# ------------------------------------------------------------- the cadence
def test_eval_every_counts_updates_in_the_loader_loop_over_two_epochs(tmp_path):
    """The issue's case: eval_every=4 over 2 epochs of 6 updates evaluates after updates 4, 8
    and 12 (it counted epochs before, and evaluated nothing), and the metrics file says so."""
    r = lt.Runner.from_module(classifier(), "cross_entropy")
    cfg = lt.LoaderTrainConfig(epochs=2, optimizer=optim.sgd(0.1), log_every=0, eval_data=class_data(2, seed=9),
                               eval_every=4, eval_metrics={"accuracy": lt.metrics.accuracy})
    report, _ = lt.train_loader(r, cfg, class_data(6), callbacks=[lt.JSONLLogger(tmp_path / "m.jsonl")])
    assert [step for step, _ in report.evals] == [4, 8, 12]
    assert all(set(res) == {"loss", "accuracy", "items"} for _, res in report.evals)
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in records if rec["kind"] == "eval"] == [4, 8, 12]


def test_the_epoch_cadence_has_its_own_name_and_both_cadences_evaluate_once_per_update():
    data = class_data(5)
    r = lt.Runner.from_module(classifier(), "cross_entropy")
    by_epoch = lt.LoaderTrainConfig(epochs=4, optimizer=optim.sgd(0.1), log_every=0, eval_data=class_data(2),
                                    eval_every_epochs=2)
    assert [s for s, _ in lt.train_loader(r, by_epoch, data)[0].evals] == [10, 20]
    default = lt.LoaderTrainConfig(epochs=2, optimizer=optim.sgd(0.1), log_every=0, eval_data=class_data(2))
    assert [s for s, _ in lt.train_loader(r, default, data)[0].evals] == [5, 10]  # no cadence: every epoch
    both = lt.LoaderTrainConfig(epochs=2, optimizer=optim.sgd(0.1), log_every=0, eval_data=class_data(2),
                                eval_every=5, eval_every_epochs=1)
    assert [s for s, _ in lt.train_loader(r, both, data)[0].evals] == [5, 10]  # update 5 ends epoch 1: once


def test_the_in_memory_loop_evaluates_every_update_without_a_cadence_and_on_it_with_one():
    r = lt.Runner.from_module(classifier(), "cross_entropy")
    cfg = lt.TrainConfig(steps=6, optimizer=optim.sgd(0.1), log_every=0, eval_data=class_data(1))
    assert [s for s, _ in lt.train_samples(r, cfg, class_data(3)).evals] == [1, 2, 3, 4, 5, 6]
    cfg = lt.TrainConfig(steps=6, optimizer=optim.sgd(0.1), log_every=0, eval_data=class_data(1), eval_every=3)
    assert [s for s, _ in lt.train_samples(r, cfg, class_data(3)).evals] == [3, 6]


@pytest.mark.parametrize("kw, message", [
    (dict(eval_every=0), "eval_every must be an integer >= 1"),
    (dict(eval_every_epochs=0), "eval_every_epochs must be an integer >= 1"),
    (dict(eval_data={}), "empty dict"),
    (dict(eval_data={"val set": [1]}), "set names must be words"),
    (dict(eval_data={"val": []}), r"eval_data\['val'\] is empty"),
    (dict(epochs=None), "epochs=None trains until max_steps"),
])
def test_bad_cadences_and_sets_are_refused_when_the_config_is_built(kw, message):
    with pytest.raises(lt.ConfigError, match=message):
        lt.LoaderTrainConfig(**{"epochs": 1, **kw})


def test_the_epoch_cadence_is_the_loader_loops_own():
    with pytest.raises(TypeError):
        lt.TrainConfig(steps=1, eval_every_epochs=1)


# -------------------------------------------------------------- named sets
def test_named_sets_are_each_evaluated_with_their_names_as_prefixes():
    val, test = class_data(2, seed=5), class_data(3, seed=6)
    r = lt.Runner.from_module(classifier(), "cross_entropy")
    metrics = {"accuracy": lt.metrics.accuracy}
    cfg = lt.TrainConfig(steps=4, optimizer=optim.sgd(0.1), log_every=0, eval_every=2, eval_metrics=metrics,
                         eval_data={"val": val, "test": test})
    report = lt.train_samples(r, cfg, class_data(3), callbacks=[lt.EarlyStopping(monitor="val_accuracy",
                                                                                  mode="max", patience=5)])
    step, res = report.evals[-1]
    assert step == 4
    assert res == {**{f"val_{k}": v for k, v in lt.evaluate(r, val, metrics).items()},
                   **{f"test_{k}": v for k, v in lt.evaluate(r, test, metrics).items()}}


def test_a_monitor_that_names_no_result_of_the_sets_is_refused_before_training():
    r = lt.Runner.from_module(classifier(), "cross_entropy")
    before = [p.detach().clone() for p in r.module.parameters()]
    cfg = lt.TrainConfig(steps=2, optimizer=optim.sgd(0.1), eval_data={"val": class_data(1)})
    with pytest.raises(lt.ConfigError, match=r"monitors 'loss'.*'val_loss'"):
        lt.train_samples(r, cfg, class_data(2), callbacks=[lt.EarlyStopping()])
    assert all(torch.equal(a, b) for a, b in zip(before, r.module.parameters()))


# ----------------------------------------------------------------- predict
def test_predict_streams_each_items_output_as_a_plain_eval_forward_gives_it():
    model = classifier()
    r = lt.Runner.from_module(model, "cross_entropy")
    data = class_data(3)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    rng = torch.get_rng_state()
    outputs = lt.predict(r, data)
    assert iter(outputs) is outputs  # an iterator: nothing computed until asked
    got = list(outputs)
    model.eval()
    with torch.no_grad():
        want = [model(x) for x, _ in data]
    model.train()
    assert len(got) == 3 and all(torch.equal(a, b) and not a.requires_grad for a, b in zip(got, want))
    assert r.mode == "train" and model.training
    assert all(torch.equal(v, buffers[k]) for k, v in model.named_buffers())  # no buffer update
    assert torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(a, b) for a, b in zip(lt.predict(r, data, collect=True), want))


def test_predict_reads_a_loader_lazily_and_leaves_its_shuffle_where_it_was():
    x, y = torch.randn(12, 4), torch.randint(0, 3, (12,))
    g = torch.Generator().manual_seed(3)
    loader = TorchLoader(TensorDataset(x, y), batch_size=4, shuffle=True, generator=g)
    state = g.get_state()
    r = lt.Runner.from_module(classifier(), "cross_entropy")
    it = lt.predict(r, loader, to="cpu")
    first = next(it)
    assert first.shape == (4, 3)
    it.close()
    assert torch.equal(g.get_state(), state)


def test_predict_never_rewinds_the_callers_draws():
    """The caller's random draws inside (and after) the loop over ``predict`` are those of
    the same loop without it: nothing is restored across the loop body, at the walk's end,
    or when an abandoned iterator is collected. A model that draws in eval mode leaves the
    caller's sequence alone too."""
    import gc

    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.lin(x) + torch.rand(3)  # draws even in eval mode

    r = lt.Runner.from_module(Noisy(), "cross_entropy")
    data = class_data(3)
    torch.manual_seed(5)
    got = [torch.rand(1) for _ in lt.predict(r, data)] + [torch.rand(1)]
    torch.manual_seed(5)
    want = [torch.rand(1) for _ in data] + [torch.rand(1)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))

    it = lt.predict(r, data)
    next(it)
    torch.manual_seed(7)
    first = torch.rand(1)
    del it
    gc.collect()  # the abandoned iterator is finalized here: it must not touch the generator
    second = torch.rand(1)
    torch.manual_seed(7)
    assert torch.equal(first, torch.rand(1)) and torch.equal(second, torch.rand(1))


def test_predict_refuses_what_is_not_a_runner():
    with pytest.raises(lt.ConfigError, match="predict: expected a Runner"):
        lt.predict(torch.nn.Linear(2, 2), [])


# ------------------------------------------------------ seeds, determinism
def test_seed_makes_dropout_and_a_torch_shuffle_repeat_and_is_recorded(tmp_path):
    x, y = torch.randn(24, 4), torch.randint(0, 3, (24,))

    def run(seed, path):
        r = lt.Runner.from_module(classifier(), "cross_entropy")
        loader = TorchLoader(TensorDataset(x, y), batch_size=6, shuffle=True)  # the global generator's shuffle
        torch.manual_seed(1234 + seed)  # whatever the generators held before, the seed decides
        cfg = lt.LoaderTrainConfig(epochs=2, optimizer=optim.sgd(0.1), log_every=1, seed=seed,
                                   checkpoint_path=path)
        report, _ = lt.train_loader(r, cfg, loader, log=None)
        return report.losses, [p.detach().clone() for p in r.module.parameters()]

    a, b, c = run(7, tmp_path / "a.ckpt"), run(7, tmp_path / "b.ckpt"), run(8, tmp_path / "c.ckpt")
    assert a[0] == b[0] and all(torch.equal(p, q) for p, q in zip(a[1], b[1]))
    assert a[0] != c[0]
    assert lt.read_checkpoint(tmp_path / "a.ckpt")[0]["progress"]["seed"] == 7


def test_seed_everything_seeds_python_numpy_and_torch():
    import random

    lt.seed_everything(3)
    first = (random.getrandbits(32), numpy.random.randint(2**31), torch.randint(2**31, ()).item())
    lt.seed_everything(3)
    assert first == (random.getrandbits(32), numpy.random.randint(2**31), torch.randint(2**31, ()).item())
    with pytest.raises(lt.ConfigError, match="seed must be an integer"):
        lt.seed_everything(-1)


def test_deterministic_mode_is_on_for_the_loop_and_put_back_after():
    seen = []

    class Look(lt.Callback):
        reads_only = True

        def on_step(self, event):
            seen.append(torch.are_deterministic_algorithms_enabled())

    r = lt.Runner.from_module(classifier(), "cross_entropy")
    assert not torch.are_deterministic_algorithms_enabled()
    cfg = lt.TrainConfig(steps=2, optimizer=optim.sgd(0.1), log_every=0, deterministic=True)
    lt.train_samples(r, cfg, class_data(2), callbacks=[Look()])
    assert seen == [True, True] and not torch.are_deterministic_algorithms_enabled()


def test_an_operation_deterministic_mode_refuses_is_named(monkeypatch):
    class Refusing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            if torch.are_deterministic_algorithms_enabled():  # what torch raises for such an operation
                raise RuntimeError("scatter_add_cuda_kernel does not have a deterministic implementation, but you "
                                   "set 'torch.use_deterministic_algorithms(True)'.")
            return x * self.w

    r = lt.Runner.from_module(Refusing(), "mse")
    cfg = lt.TrainConfig(steps=1, optimizer=optim.sgd(0.1), log_every=0, deterministic=True, measure_loss=False)
    with pytest.raises(lt.ConfigError, match="no deterministic implementation of scatter_add_cuda_kernel"):
        lt.train_samples(r, cfg, [(torch.ones(3), torch.zeros(3))])
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.equal(r.module.w.detach(), torch.ones(3))


@pytest.mark.parametrize("kw, message", [
    (dict(seed=-1), "seed must be an integer"),
    (dict(seed=2**32), "seed must be an integer"),
    (dict(deterministic="yes"), "deterministic must be True, False or 'warn'"),
    (dict(peak_flops=0), "peak_flops must be a positive number"),
    (dict(profile=(3, 2), profile_dir="p"), "profile must be"),
    (dict(profile=(1, 2)), "set profile_dir"),
    (dict(profile_dir="p"), "profile_dir is set but profile is not"),
])
def test_run_options_are_checked_when_the_config_is_built(kw, message):
    with pytest.raises(lt.ConfigError, match=message):
        lt.TrainConfig(steps=1, **kw)


# ------------------------------------------------------ loop-start checks
def test_a_callback_whose_state_holds_a_tensor_is_refused_before_the_first_update(tmp_path):
    class Keeps(lt.Callback):
        def state_dict(self):
            return {"best": torch.tensor(1.0)}

    r = lt.Runner.from_module(classifier(), "cross_entropy")
    before = [p.detach().clone() for p in r.module.parameters()]
    cfg = lt.TrainConfig(steps=2, optimizer=optim.sgd(0.1), log_every=0, checkpoint_path=tmp_path / "c.ckpt")
    with pytest.raises(lt.ConfigError, match=r"Keeps.state_dict\(\) is not JSON data"):
        lt.train_samples(r, cfg, class_data(2), callbacks=[Keeps()])
    assert all(torch.equal(a, b) for a, b in zip(before, r.module.parameters()))
    assert not (tmp_path / "c.ckpt").exists()


def test_epochs_none_trains_until_max_steps_and_max_steps_beyond_the_epochs_warns_once():
    r = lt.Runner.from_module(classifier(), "cross_entropy")
    cfg = lt.LoaderTrainConfig(epochs=None, max_steps=13, optimizer=optim.sgd(0.1), log_every=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report, _ = lt.train_loader(r, cfg, class_data(5))
    assert report.steps == 13
    cfg = lt.LoaderTrainConfig(epochs=1, max_steps=13, optimizer=optim.sgd(0.1), log_every=0)
    with pytest.warns(UserWarning, match="epochs=1 ended after 5 updates, before max_steps=13"):
        assert lt.train_loader(r, cfg, class_data(5))[0].steps == 5
