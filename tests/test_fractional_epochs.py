"""Fractional ``epochs`` (#70), as Trainer's ``num_train_epochs=1.5``: the whole epochs, then
that fraction of the next epoch's updates, rounded up; Trainer run live gives the same
number of updates. A loader without a length is refused by name; a resume is exact."""

import pytest
import torch

import leantrain as lt
from injection import kill_at, unless_killed


def data(n=40):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(3, generator=g), torch.randn(1, generator=g)) for _ in range(n)]


def run(epochs, tmp_path=None, kill=None, resume=None, **kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    cfg = lt.LoaderTrainConfig(epochs=epochs, log_every=1, optimizer=lt.optim.sgd(0.05),
                               checkpoint_path=None if tmp_path is None else tmp_path / "ck",
                               checkpoint_every=0 if tmp_path is None else 1, resume_from=resume, **kw)
    loader = lt.DataLoader(data(), batch_size=8, shuffle=True, seed=2)
    done = unless_killed(lambda: lt.train_loader(lt.Runner.from_module(model, "mse"), cfg, loader, log=None,
                                                 callback=kill_at(kill)))
    return (None if done is None else done[0]), model


@pytest.mark.parametrize("epochs, accumulate, updates", [(1.5, 1, 8), (0.5, 1, 3), (2.25, 1, 12), (1.5, 2, 5)])
def test_a_fraction_of_an_epoch_is_that_fraction_of_its_updates(epochs, accumulate, updates):
    report, _ = run(epochs, accumulate=accumulate)  # 5 loader batches an epoch
    assert report.steps == updates
    whole, _ = run(int(epochs) + 1, accumulate=accumulate, max_steps=updates)  # the same run, by max_steps
    assert whole.losses == report.losses


def test_a_fractional_run_resumes_exactly_and_a_stream_is_refused(tmp_path):
    straight, model = run(1.5)
    run(1.5, tmp_path, kill=6)
    resumed, again = run(1.5, tmp_path, resume="auto")
    assert resumed.losses == straight.losses and all(torch.equal(a, b) for a, b in
                                                     zip(model.parameters(), again.parameters()))
    class Stream:  # re-iterable, without a length
        def __iter__(self):
            return iter([data(8)])

    with pytest.raises(lt.ConfigError, match="epochs=1.5 counts a fraction of an epoch's updates, but the loader has "
                                             "no length"):
        lt.train_loader(lt.Runner.from_module(torch.nn.Linear(3, 1), "mse"), lt.LoaderTrainConfig(epochs=1.5),
                        Stream(), log=None)
    with pytest.raises(lt.ConfigError, match="epochs must be an integer >= 0 or a finite number > 0"):
        lt.LoaderTrainConfig(epochs=float("nan"))


def test_trainer_makes_as_many_updates_for_num_train_epochs_1_5(tmp_path):
    transformers = pytest.importorskip("transformers")

    class Regression(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)

        def forward(self, x, labels):
            return {"loss": torch.nn.functional.mse_loss(self.lin(x), labels)}

    rows = [{"x": x, "labels": y} for x, y in data()]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8,
                                          num_train_epochs=1.5, report_to=[], use_cpu=True, save_strategy="no",
                                          disable_tqdm=True, learning_rate=0.05)
    trainer = transformers.Trainer(model=Regression(), args=args, train_dataset=rows,
                                   data_collator=transformers.default_data_collator)
    trainer.train()
    assert trainer.state.global_step == run(1.5)[0].steps == 8
