"""The moving average of the weights (``ema_decay``) on every zoo model against
``torch.optim.swa_utils.AveragedModel`` with ``get_ema_multi_avg_fn`` updated after each
``torch.optim`` step of the hand-written loop; saved, resumed, evaluated and exported."""

import copy

import pytest
import torch
from safetensors.torch import load_file
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import leantrain as lt
from leantrain import optim
from leantrain.cli import main
from oracle import OPTIMIZERS, run_both
from zoo_models import ZOO

DECAY = 0.8


def torch_ema(model, entry, samples, opt_name):
    _, cls, kwargs, _ = OPTIMIZERS[opt_name]
    avg = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    opt = cls([p for p in model.parameters() if p.requires_grad], **kwargs)
    for x, y in samples:
        opt.zero_grad(set_to_none=True)
        entry.loss_fn()(model(x), y).backward()
        opt.step()
        avg.update_parameters(model)
    return dict(avg.module.named_parameters())


def ours_by_name(runner):
    return dict(zip(runner.params.names, runner.ema_values()))


@pytest.mark.parametrize("mirror", [False, True], ids=["host", "mirror"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
def test_ema_equals_averaged_model(entry, opt_name, mirror):
    theirs = {}
    both = run_both(entry, opt_name, lt.TrainConfig(steps=4, batch_size=1, log_every=0, ema_decay=DECAY),
                    mirror=mirror, seed=7,
                    reference=lambda ref, batches: theirs.update(torch_ema(ref, entry, [b[0] for b in batches],
                                                                           opt_name)))
    model, r = both.model, both.runner
    ours = ours_by_name(r)
    exact = OPTIMIZERS[opt_name][3] and not entry.tied  # single items: autograd's gradients, the same kernels
    for name, t in theirs.items():
        if not t.requires_grad:
            continue  # a frozen parameter: AveragedModel averages it too, leantrain keeps its value
        if exact:
            assert torch.equal(ours[name], t), name
        else:
            torch.testing.assert_close(ours[name], t.detach(), rtol=2e-5, atol=1e-6)
    for name, value in model.state_dict().items():  # buffers and frozen slots: their value
        if name in ours and name not in {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}:
            assert torch.equal(ours[name], value), name


def test_the_loader_loop_keeps_one_too():
    entry = next(e for e in ZOO if e.name == "cnn_batchnorm")
    model = entry.model()
    ref = copy.deepcopy(model)
    samples = entry.samples(4)
    r = lt.Runner.from_module(model, entry.loss)
    torch.manual_seed(7)
    lt.train_loader(r, lt.LoaderTrainConfig(epochs=1, optimizer=optim.sgd(0.1), log_every=0, ema_decay=DECAY),
                    [[s] for s in samples])
    torch.manual_seed(7)
    theirs = torch_ema(ref, entry, samples, "sgd")
    ours = ours_by_name(r)
    assert all(torch.equal(ours[n], t) for n, t in theirs.items())


def digits_like(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 6, generator=g), torch.randint(0, 3, (2,), generator=g)) for _ in range(n)]


def classifier(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


@pytest.mark.parametrize("stop_at", [1, 5])
def test_a_resume_keeps_the_average_exactly(tmp_path, stop_at):
    data = digits_like(12)
    cfg = lt.TrainConfig(steps=8, batch_size=3, optimizer=optim.adam(0.01), log_every=2, ema_decay=0.9,
                         checkpoint_path=tmp_path / "a.ckpt", eval_data=data[:4], eval_every=2, eval_ema=True)
    straight = lt.Runner.from_module(classifier(), "cross_entropy")
    full = lt.train_samples(straight, cfg, data, log=lambda s: None)
    first = lt.Runner.from_module(classifier(), "cross_entropy")
    lt.train_samples(first, lt.TrainConfig(**{**cfg.__dict__, "checkpoint_path": tmp_path / "b.ckpt"}), data,
                     log=lambda s: None, callback=lambda ev: ev.step == stop_at)
    resumed = lt.Runner.from_module(classifier(seed=3), "cross_entropy")
    report = lt.train_samples(resumed, lt.TrainConfig(**{**cfg.__dict__, "resume_from": tmp_path / "b.ckpt",
                                                        "checkpoint_path": tmp_path / "c.ckpt"}), data,
                              log=lambda s: None)
    assert report.losses == full.losses and report.evals == full.evals
    assert all(torch.equal(a, b) for a, b in zip(straight.ema_values(), resumed.ema_values()))


def test_evaluate_with_the_average_and_put_the_weights_back():
    data = digits_like(10)
    r = lt.Runner.from_module(classifier(), "cross_entropy")
    lt.train_samples(r, lt.TrainConfig(steps=6, batch_size=2, optimizer=optim.adam(0.05), log_every=0, ema_decay=0.5),
                     data)
    trained = r.params.values_synced()
    with_ema = lt.evaluate(r, data, {"accuracy": lt.metrics.accuracy}, ema=True)
    assert all(torch.equal(a, b) for a, b in zip(trained, r.params.values_synced()))  # put back
    other = lt.Runner.from_module(classifier(seed=5), "cross_entropy")
    other.params.set_values(r.ema_values())
    assert lt.evaluate(other, data, {"accuracy": lt.metrics.accuracy}) == with_ema
    assert with_ema != lt.evaluate(r, data, {"accuracy": lt.metrics.accuracy})


def test_export_the_average(tmp_path, capsys):
    data = digits_like(10)
    model = classifier()
    r = lt.Runner.from_module(model, "cross_entropy")
    lt.train_samples(r, lt.TrainConfig(steps=4, batch_size=2, optimizer=optim.adam(0.05), log_every=0, ema_decay=0.5,
                                       checkpoint_path=tmp_path / "run.ckpt"), data)
    lt.weights.save_weights(tmp_path / "api.safetensors", r, ema=True)
    assert main(["export", str(tmp_path / "run.ckpt"), "--weights", "--ema", "-o", str(tmp_path / "cli.safetensors")]) == 0
    fresh = classifier(seed=9)
    fresh.load_state_dict(load_file(str(tmp_path / "cli.safetensors")))  # plain torch loads it
    by_name = dict(zip(r.params.names, r.ema_values()))
    assert all(torch.equal(v, by_name[k]) for k, v in fresh.state_dict().items())
    api, cli = load_file(str(tmp_path / "api.safetensors")), load_file(str(tmp_path / "cli.safetensors"))
    assert sorted(api) == sorted(cli) and all(torch.equal(api[k], cli[k]) for k in api)
    assert main(["export", str(tmp_path / "run.ckpt"), "--weights", "-o", str(tmp_path / "raw.safetensors")]) == 0
    raw = load_file(str(tmp_path / "raw.safetensors"))
    assert not torch.equal(raw["0.weight"], cli["0.weight"])


def test_mistakes(tmp_path, capsys):
    r = lt.Runner.from_module(classifier(), "cross_entropy")
    with pytest.raises(lt.ConfigError, match="no moving average"):
        r.ema_values()
    with pytest.raises(lt.ConfigError, match="keeps no moving average"):
        lt.evaluate(r, digits_like(2), ema=True)
    with pytest.raises(lt.ConfigError, match="eval_ema evaluates the moving average: set ema_decay"):
        lt.TrainConfig(steps=1, eval_ema=True, eval_data=digits_like(2))
    for bad in (1.0, -0.1, float("nan"), "0.9", True):
        with pytest.raises(lt.ConfigError, match="ema_decay"):
            lt.LoaderTrainConfig(epochs=1, ema_decay=bad)
    data = digits_like(6)
    lt.train_samples(r, lt.TrainConfig(steps=2, batch_size=2, log_every=0, ema_decay=0.9,
                                       checkpoint_path=tmp_path / "a.ckpt"), data)
    with pytest.raises(lt.CheckpointError, match="ema: checkpoint has 0.9, this run has ema_decay=0.5"):
        lt.train_samples(lt.Runner.from_module(classifier(), "cross_entropy"),
                         lt.TrainConfig(steps=4, batch_size=2, ema_decay=0.5, resume_from=tmp_path / "a.ckpt"), data)
    with pytest.raises(lt.CheckpointError, match="ema_decay: checkpoint has 0.9, this run has None"):
        lt.train_samples(lt.Runner.from_module(classifier(), "cross_entropy"),
                         lt.TrainConfig(steps=4, batch_size=2, resume_from=tmp_path / "a.ckpt"), data)
    plain = tmp_path / "plain.ckpt"
    lt.save_checkpoint(plain, r, rng=False)
    assert main(["export", str(plain), "--weights", "--ema", "-o", str(tmp_path / "x")]) == 2
    assert "holds no moving average" in capsys.readouterr().err
