"""A torchvision-style classification recipe ports with its bits (#56): each recipe of
``recipe.py`` (SGD momentum + StepLR; SGD + label smoothing + linear warm-up + cosine +
norm weight decay 0 + clipping; AdamW + an EMA every 2 updates with torchvision's warm-up;
MixUp/CutMix in the collate from Python's ``random``; ``RASampler`` + ExponentialLR),
written as a user writes it with leantrain, equals the reference loop bit for bit
(weights and buffers, EMA weights and buffers, each epoch's evaluation, each epoch's rate)
with torch's default optimizer path and with ``fused=True``; and so does a run resumed in
a fresh process mid-epoch and at an epoch's last update."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import recipe as R

HERE = Path(__file__).parent


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("impl", ["default", "fused"])
@pytest.mark.parametrize("name", R.RECIPES)
def test_the_recipe_as_a_user_writes_it_gives_the_reference_loops_bits(name, impl):
    assert R.same(R.ours(name, impl), R.reference(name, impl)) == []


@pytest.mark.filterwarnings("ignore")
def test_evaluation_that_restores_its_draws_is_the_other_named_setting():
    """``eval_draws="restore"`` (evaluation changes nothing) is not the hand-written loop's:
    from the second epoch on the shuffles differ."""
    assert "evals" in R.same(R.ours("sgd-steplr", "default", draws="restore"), R.reference("sgd-steplr", "default"))


def _child(*args) -> None:
    env = dict(os.environ, LEANTRAIN_THREADS=str(torch.get_num_threads()))
    done = subprocess.run([sys.executable, str(HERE / "recipe.py"), *map(str, args)], capture_output=True, text=True,
                          cwd=HERE, env=env)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", ["adamw-ema", "mixup-cutmix", "rasampler-exp"])
@pytest.mark.parametrize("stop", [4, 6], ids=["mid-epoch", "epoch-end"])
def test_a_run_resumed_in_a_fresh_process_gives_the_reference_loops_bits(tmp_path, name, stop):
    """6 updates an epoch: killed after update 4 (mid-epoch) or 6 (the epoch's last),
    resumed in another process; Python's and NumPy's generators come back with torch's."""
    ckpt = tmp_path / "run.ckpt"
    _child(name, "default", ckpt, tmp_path / "first.pt", stop)
    _child(name, "default", ckpt, tmp_path / "second.pt", "-", "resume")
    first, second = torch.load(tmp_path / "first.pt"), torch.load(tmp_path / "second.pt")
    reference = R.reference(name, "default")
    joined = dict(second, ema_evals=first["ema_evals"] + second["ema_evals"],
                  rates=first["rates"] + [r for r in second["rates"]])
    assert first["steps"] == stop and second["steps"] == 18
    assert R.same(joined, reference) == []
