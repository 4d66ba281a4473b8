"""TensorBoard's steps are the update numbers (from 1) for training and evaluation alike,
kept across a resume: the evaluation made at the checkpoint's update survives the resumed
run's purge, and the whole log equals the straight run's (#54 item 2)."""

from __future__ import annotations

import pytest
import torch

import leantrain as lt
from leantrain import optim

pytest.importorskip("tensorboard")


def _scalars(folder) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _run(folder, ckpt, steps, resume=None):
    torch.manual_seed(0)
    data = [(torch.randn(2, 3, generator=torch.Generator().manual_seed(k)), torch.randn(2, 1)) for k in range(8)]
    runner = lt.Runner.from_module(torch.nn.Linear(3, 1), "mse")
    cfg = lt.TrainConfig(steps=steps, optimizer=optim.sgd(0.05), log_every=1, eval_data=data[:2], eval_every=2,
                         checkpoint_path=ckpt, checkpoint_every=2, resume_from=resume, eval_at_end=False)
    lt.train_samples(runner, cfg, data, log=None, callbacks=[lt.TensorBoardLogger(folder)])


def test_a_resumed_runs_log_is_the_straight_runs(tmp_path):
    _run(tmp_path / "straight", tmp_path / "s.ckpt", 8)
    _run(tmp_path / "resumed", tmp_path / "r.ckpt", 4)
    _run(tmp_path / "resumed", tmp_path / "r.ckpt", 8, resume=tmp_path / "r.ckpt")
    straight, resumed = _scalars(tmp_path / "straight"), _scalars(tmp_path / "resumed")
    assert [s for s, _ in straight["eval/loss"]] == [2, 4, 6, 8]
    assert [s for s, _ in straight["train/loss"]] == list(range(1, 9))
    for tag in ("eval/loss", "train/loss"):
        assert sorted(resumed[tag]) == straight[tag], tag  # the eval at update 4 (the checkpoint's) kept
