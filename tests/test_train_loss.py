"""``TrainReport.train_loss`` (#70): the run's mean training loss, Trainer's ``train_loss``:
the mean over the run's updates of each update's mean loss before its step, the items
weighted as the update weights them (``1/n``, or a ``LossSum``'s counts), exact on resume,
a skipped update left out; in ``report.json`` too. Nothing is read from the device until
the run ends or a checkpoint is written. On ranks: ``tests/parallel/run_table_cases.py``
(every world's report equal to one process's)."""

import json

import pytest
import torch
from torch import nn

import leantrain as lt
from leantrain.cli.main import main


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))


def data(n=12, rows=None):
    g = torch.Generator().manual_seed(2)
    if rows is None:
        return [(torch.randn(3, generator=g), torch.randn(1, generator=g)) for _ in range(n)]
    return [(torch.randn(r, 3, generator=g), torch.randn(r, 1, generator=g)) for r in rows]


def config(**more):
    return lt.TrainConfig(**{"steps": 4, "batch_size": 3, "optimizer": lt.optim.sgd(0.1), "log_every": 0, **more})


def hand_losses(items, loss_of, steps=4, batch=3):
    """torch's loop: each update's mean over its items (float32), before its step."""
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    out = []
    for s in range(steps):
        chunk = [items[(s * batch + j) % len(items)] for j in range(batch)]
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, chunk)
        loss.backward()
        out.append(loss.detach())
        opt.step()
    return out


def test_the_mean_of_the_updates_losses_as_torchs_loop_measures_them():
    items = data()
    report = lt.train_samples(lt.Runner.from_module(net(), "mse"), config(), items, log=None)
    mine = hand_losses(items, lambda m, c: sum((torch.nn.functional.mse_loss(m(x), y) for x, y in c[1:]),
                                               torch.nn.functional.mse_loss(m(c[0][0]), c[0][1])) * (1 / 3))
    want = sum(float(x) for x in mine) / 4
    assert report.train_loss == pytest.approx(want, rel=1e-6)
    assert report.losses == ()  # nothing logged: the mean needs no log line


def test_a_loss_sum_weights_each_update_by_its_counts():
    items = data(rows=[1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4])

    def summed(out, y):
        return lt.LossSum(((out - y) ** 2).sum(), y.shape[0])

    report = lt.train_samples(lt.Runner.from_module(net(), summed), config(), items, log=None)
    mine = hand_losses(items, lambda m, c: sum(((m(x) - y) ** 2).sum() for x, y in c) / sum(y.shape[0] for _, y in c))
    assert report.train_loss == pytest.approx(sum(float(x) for x in mine) / 4, rel=1e-6)


@pytest.mark.parametrize("stop", [4, 64, 70])
def test_a_resumed_run_gives_the_straight_runs_mean_bit_for_bit(tmp_path, stop):
    """Stopped mid-group, at a group's end (64 updates are summed at once) and past it."""
    items = data()
    steps = 140
    straight = lt.train_samples(lt.Runner.from_module(net(), "mse"), config(steps=steps), items, log=None)
    path = tmp_path / "run.ckpt"
    first = lt.train_samples(lt.Runner.from_module(net(), "mse"), config(steps=steps, checkpoint_path=str(path)),
                             items, log=None, callback=lambda e: e.step == stop)
    assert first.steps == stop and first.interrupted
    resumed = lt.train_samples(lt.Runner.from_module(net(), "mse"), config(steps=steps, resume_from=str(path)),
                               items, log=None)
    assert resumed.steps == steps and resumed.train_loss == straight.train_loss


def test_a_skipped_update_is_left_out():
    items = data()
    items[4] = (torch.full((3,), float("nan")), torch.zeros(1))  # update 2 (items 3-5) is non-finite
    report = lt.train_samples(lt.Runner.from_module(net(), "mse"), config(nonfinite="skip", log_every=1), items,
                              log=None)
    assert report.skipped_steps == 1
    finite = [loss for _, loss in report.losses if loss == loss]
    assert len(finite) == 3 and report.train_loss == pytest.approx(sum(finite) / 3, rel=1e-12)  # the NaN left out


def test_logged_losses_average_to_it_and_an_older_file_says_unknown(tmp_path):
    items = data()
    path = tmp_path / "run.ckpt"
    report = lt.train_samples(lt.Runner.from_module(net(), "mse"), config(log_every=1, checkpoint_path=str(path)),
                              items, log=None)
    assert report.train_loss == pytest.approx(sum(loss for _, loss in report.losses) / 4, rel=1e-12)
    manifest, tensors = lt.read_checkpoint(path)
    p = manifest["progress"]  # 4 updates: still one group, kept as its values
    assert p["train_loss_updates"] == 0 and len(p["train_loss_pending"]) == 4
    # a file written before the mean was kept: a resume cannot know the earlier updates' losses
    progress = dict(manifest["progress"])
    del progress["train_loss_sum"], progress["train_loss_updates"]
    from leantrain.training.loops.record import RunRecord
    record = RunRecord()
    record.resume(progress)
    assert record.train_loss.mean() is None


def test_the_command_writes_train_loss_in_report_json(tmp_path):
    assert main(["train", "--max-steps", "3", "--out", str(tmp_path / "run")]) == 0
    got = json.loads((tmp_path / "run" / "report.json").read_text())
    assert got["train_loss"] > 0 and got["steps"] == 3


def test_trainers_training_loss_live_with_the_same_weighting(tmp_path):
    """Trainer run live (``TrainOutput.training_loss``: the mean over its steps of each
    step's loss, micro-batches averaged) against ``train_loss`` on the same rows, at a rate
    of 0 (no update moves the parameters, so the order the two shuffles pick does not
    matter): one minibatch per update, and two accumulated per update."""
    transformers = pytest.importorskip("transformers")

    class Regression(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(3, 1)

        def forward(self, x, labels):
            return {"loss": torch.nn.functional.mse_loss(self.lin(x), labels)}

    rows = data(48)
    for accumulate in (1, 2):
        args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8,
                                              gradient_accumulation_steps=accumulate, num_train_epochs=1,
                                              report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                                              learning_rate=0.0)
        trainer = transformers.Trainer(model=Regression(), args=args,
                                       train_dataset=[{"x": x, "labels": y} for x, y in rows],
                                       data_collator=transformers.default_data_collator)
        theirs = trainer.train().training_loss
        model = Regression().lin
        cfg = lt.LoaderTrainConfig(epochs=1, optimizer=lt.optim.sgd(0.0), log_every=0, accumulate=accumulate)
        report, _ = lt.train_loader(lt.Runner.from_module(model, "mse"), cfg,
                                    lt.DataLoader(rows, batch_size=8, shuffle=True, seed=1, collate=lt.collate.stack))
        assert report.steps == trainer.state.global_step == 6 // accumulate
        assert report.train_loss == pytest.approx(theirs, rel=1e-6)
