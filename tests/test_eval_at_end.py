"""The run's last update is evaluated (and, keeping the best, ranked) when it falls off the
``eval_every`` cadence, as Trainer does; ``eval_at_end=False`` turns it off (#54 item 5)."""

from __future__ import annotations

import pytest
import torch

import leantrain as lt
from leantrain import optim


def _data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(3, generator=g), torch.randn(1, generator=g)) for _ in range(10)]


@pytest.mark.parametrize("at_end, want", [(True, [4, 8, 10]), (False, [4, 8])])
def test_samples_loop_evaluates_the_last_update_off_the_cadence(at_end, want):
    torch.manual_seed(0)
    runner = lt.Runner.from_module(torch.nn.Linear(3, 1), "mse")
    report = lt.train_samples(runner, lt.TrainConfig(steps=10, optimizer=optim.sgd(0.1), log_every=0, eval_data=_data(),
                                                     eval_every=4, eval_at_end=at_end), _data(), log=None)
    assert [s for s, _ in report.evals] == want


def test_loader_loop_evaluates_its_last_update_once_and_keeps_it_when_best(tmp_path):
    """10 updates (5 an epoch), eval_every=4: evaluations at 4, 8 and 10 (the epoch end at 10
    does not evaluate twice); keep_best ranks update 10's checkpoint."""
    torch.manual_seed(0)
    runner = lt.Runner.from_module(torch.nn.Linear(3, 1), "mse")
    cfg = lt.LoaderTrainConfig(epochs=2, optimizer=optim.sgd(0.05), log_every=0, eval_data=_data()[:4], eval_every=4,
                               checkpoint_path=tmp_path / "run" / "step{step}.ckpt", keep_best=1)
    report, _ = lt.train_loader(runner, cfg, lt.DataLoader(_data(), batch_size=2), log=None)
    assert [s for s, _ in report.evals] == [4, 8, 10]
    losses = {s: r["loss"] for s, r in report.evals}
    best = min(losses, key=losses.get)
    assert report.best_checkpoint is not None and f"step{best}" in report.best_checkpoint
