"""``limit_train_batches`` and ``limit_eval_batches`` (#70), Lightning's quick-iteration
habit: a number of batches or a fraction of them per epoch (per evaluation set), exact on
resume, a resume with another limit refused."""

import pytest
import torch

import leantrain as lt
from injection import kill_at, unless_killed


def samples(n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(3, generator=g), torch.randn(1, generator=g)) for _ in range(n)]


def loader():
    return lt.DataLoader(samples(), batch_size=8, shuffle=True, seed=3)  # 6 batches an epoch


def run(tmp_path=None, kill=None, resume=None, **kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    cfg = lt.LoaderTrainConfig(epochs=2, optimizer=lt.optim.sgd(0.05), log_every=1,
                               checkpoint_path=None if tmp_path is None else tmp_path / "ck",
                               checkpoint_every=0 if tmp_path is None else 1, resume_from=resume, **kw)

    done = unless_killed(lambda: lt.train_loader(lt.Runner.from_module(model, "mse"), cfg, loader(), log=None,
                                                 callback=kill_at(kill)))
    return (None if done is None else done[0]), model


def test_a_limit_reads_the_first_batches_of_each_epoch_as_a_hand_loop_does():
    report, model = run(limit_train_batches=3)
    assert report.steps == 6 and [s for s, _ in report.losses] == list(range(1, 7))
    torch.manual_seed(0)
    ref = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    data = loader()
    for _ in range(2):
        data, batches = data.epoch()
        for batch in batches[:3]:  # a hand loop that stops each epoch after 3 batches
            opt.zero_grad()
            for x, y in batch:
                torch.nn.functional.mse_loss(ref(x), y).backward()
            for p in ref.parameters():
                p.grad.mul_(1 / len(batch))
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    half, _ = run(limit_train_batches=0.5)  # half of 6 batches: the same run
    assert half.losses == report.losses


def test_a_limited_run_resumes_exactly_and_refuses_another_limit(tmp_path):
    straight, model = run(limit_train_batches=3)
    run(tmp_path, kill=5, limit_train_batches=3)  # killed in the second epoch (its second batch)
    resumed, again = run(tmp_path, resume="auto", limit_train_batches=3)
    assert resumed.steps == 6 and resumed.losses == straight.losses
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    with pytest.raises(lt.CheckpointError, match="limit_train_batches: checkpoint has 3, this run has 4"):
        run(tmp_path, resume="auto", limit_train_batches=4)


def test_bad_limits_are_refused_before_anything_changes():
    with pytest.raises(lt.ConfigError, match="limit_train_batches must be a number of batches"):
        lt.LoaderTrainConfig(epochs=1, limit_train_batches=0)
    with pytest.raises(lt.ConfigError, match="limit_eval_batches must be a number of batches"):
        lt.TrainConfig(steps=1, limit_eval_batches=1.5)
    runner = lt.Runner.from_module(torch.nn.Linear(3, 1), "mse")
    before = [p.clone() for p in runner.module.parameters()]
    stream = (b for b in [samples(8)])  # no length: a fraction of it means nothing
    with pytest.raises(lt.ConfigError, match="limit_train_batches=0.5 is a fraction of the batches, but the data has "
                                             "no length"):
        lt.train_loader(runner, lt.LoaderTrainConfig(epochs=1, limit_train_batches=0.5), stream, log=None)
    with pytest.raises(lt.ConfigError, match=r"limit_train_batches=0.1 of 6 batches is no batch"):
        lt.train_loader(runner, lt.LoaderTrainConfig(epochs=1, limit_train_batches=0.1), loader(), log=None)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.module.parameters()))


@pytest.mark.parametrize("kind", ["list", "leantrain", "torch"])
def test_an_evaluation_reads_the_first_batches_of_each_set(kind):
    data = samples(24, seed=5)
    whole = {"list": data, "leantrain": lt.DataLoader(data, batch_size=8),
             "torch": torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
                 torch.stack([x for x, _ in data]), torch.stack([y for _, y in data])), batch_size=8)}[kind]
    first = {"list": data[:2], "leantrain": data[:16], "torch": [(torch.stack([x for x, _ in data[:8]]),
                                                                 torch.stack([y for _, y in data[:8]])),
                                                                (torch.stack([x for x, _ in data[8:16]]),
                                                                 torch.stack([y for _, y in data[8:16]]))]}[kind]
    runner = lt.Runner.from_module(torch.nn.Linear(3, 1), "mse")
    assert lt.evaluate(runner, whole, limit_batches=2) == lt.evaluate(runner, first)
    if kind != "list":
        assert lt.evaluate(runner, whole, limit_batches=2 / 3) == lt.evaluate(runner, first)
    cfg = lt.TrainConfig(steps=2, eval_data=whole, limit_eval_batches=2, log_every=0)
    report = lt.train_samples(runner, cfg, samples(4), log=None)
    assert report.evals[-1][1]["items"] == lt.evaluate(runner, first)["items"]
