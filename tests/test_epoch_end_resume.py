"""A checkpoint written at an epoch's last update (by ``checkpoint_every`` or ``max_steps``
landing there) resumes into exactly what the straight run does at that boundary: the
epoch's evaluation and every callback's ``on_epoch_end`` happen once, before or after
the interruption, never skipped, never twice (#56 item 4)."""

from __future__ import annotations

import pytest
import torch

import leantrain as lt
from leantrain import optim


class Ends(lt.Callback):
    """What ran in this process: epoch ends and evaluations."""

    def __init__(self):
        self.ends, self.evals = [], []

    def on_epoch_end(self, event):
        self.ends.append(event.epoch)

    def on_eval(self, step, results):
        self.evals.append(step)


def _runner():
    torch.manual_seed(0)
    return lt.Runner.from_module(torch.nn.Linear(3, 1), "mse")


def _data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(3, generator=g), torch.randn(1, generator=g)) for _ in range(8)]


def _cfg(path, **kw):
    return lt.LoaderTrainConfig(epochs=4, optimizer=optim.adam(0.01), log_every=1, eval_data=_data()[:3],
                                checkpoint_path=path, **kw)


def _loader():
    return lt.DataLoader(lt.Dataset(_data()), batch_size=2, shuffle=True, seed=3)  # 4 updates an epoch


@pytest.mark.parametrize("how", ["max_steps", "checkpoint_every", "stop_at_update"])
def test_a_resume_at_an_epochs_last_update_replays_its_end_once(tmp_path, how):
    straight_ends = Ends()
    straight, _ = lt.train_loader(_runner(), _cfg(tmp_path / "s.ckpt"), _loader(), log=None, callbacks=[straight_ends])
    assert [s for s, _ in straight.evals] == [4, 8, 12, 16] and straight_ends.ends == [0, 1, 2, 3]

    first_ends = Ends()
    path = tmp_path / "r.ckpt"
    if how == "max_steps":
        first, _ = lt.train_loader(_runner(), _cfg(path, max_steps=8), _loader(), log=None, callbacks=[first_ends])
    elif how == "checkpoint_every":
        first, _ = lt.train_loader(_runner(), _cfg(path, checkpoint_every=4), _loader(), log=None,
                                   callbacks=[first_ends], callback=lambda e: e.step == 8)
    else:
        first, _ = lt.train_loader(_runner(), _cfg(path), _loader(), log=None, callbacks=[first_ends],
                                   callback=lambda e: e.step == 8)
    second_ends = Ends()
    resumed_runner = _runner()
    second, _ = lt.train_loader(resumed_runner, _cfg(path, resume_from=path), _loader(), log=None,
                                callbacks=[second_ends])
    assert first.steps == 8
    assert first_ends.evals + second_ends.evals == [4, 8, 12, 16]  # each once, across the two processes
    assert first_ends.ends + second_ends.ends == [0, 1, 2, 3]
    assert second.evals == straight.evals  # the resumed report carries the earlier ones
    straight_runner = _runner()
    lt.train_loader(straight_runner, _cfg(tmp_path / "s2.ckpt"), _loader(), log=None)
    assert all(torch.equal(a, b) for a, b in zip(straight_runner.params.values(), resumed_runner.params.values()))
