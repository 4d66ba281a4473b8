"""A resume that does not fit the run is refused before anything is installed:
parameters, mirrors and the global random generator stay as they were (hostile review)."""

import pytest
import torch

import leantrain as lt
from leantrain import optim
from models import TiedNet, regression_batches


def saved(tmp_path, kind):
    torch.manual_seed(0)
    r = lt.Runner.from_module(TiedNet(bn=True), "mse")
    path = tmp_path / f"{kind}.ckpt"
    data = regression_batches(6, 3)
    if kind == "samples":
        lt.train_samples(r, lt.TrainConfig(steps=3, batch_size=2, log_every=0, checkpoint_path=path), data)
    else:
        loader = lt.DataLoader(lt.Dataset(data), batch_size=2, shuffle=True, seed=1)
        lt.train_loader(r, lt.LoaderTrainConfig(epochs=1, log_every=0, checkpoint_path=path), loader)
    return path, data


@pytest.mark.parametrize("case, match", [
    ("another batch_size", "batch_size: checkpoint has 2, this run has 3"),
    ("a loader checkpoint into train_samples", "not a samples training checkpoint"),
    ("another loader batch size", "loader batch_size: checkpoint has 2, this loader has 3"),
    ("a samples checkpoint into train_loader", "not a loader training checkpoint"),
])
def test_an_incompatible_resume_changes_nothing(tmp_path, unchanged, case, match):
    source = "loader" if "loader batch size" in case or "loader checkpoint" in case else "samples"
    path, data = saved(tmp_path, source)
    torch.manual_seed(1)
    r = lt.Runner.from_module(TiedNet(bn=True), "mse")
    rng = torch.get_rng_state()
    with unchanged(r.params), pytest.raises(lt.CheckpointError, match=match):
        if case == "another batch_size":
            lt.train_samples(r, lt.TrainConfig(steps=5, batch_size=3, resume_from=path), data)
        elif case == "a loader checkpoint into train_samples":
            lt.train_samples(r, lt.TrainConfig(steps=5, batch_size=2, resume_from=path), data)
        elif case == "another loader batch size":
            loader = lt.DataLoader(lt.Dataset(data), batch_size=3, shuffle=True, seed=1)
            lt.train_loader(r, lt.LoaderTrainConfig(epochs=2, resume_from=path), loader)
        else:
            loader = lt.DataLoader(lt.Dataset(data), batch_size=2, shuffle=True, seed=1)
            lt.train_loader(r, lt.LoaderTrainConfig(epochs=2, resume_from=path), loader)
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_fitting_resume_still_installs(tmp_path):
    path, data = saved(tmp_path, "samples")
    r = lt.Runner.from_module(TiedNet(bn=True), "mse")
    report = lt.train_samples(r, lt.TrainConfig(steps=5, batch_size=2, log_every=0, resume_from=path), data)
    assert report.steps == 5
