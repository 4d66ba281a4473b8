"""Loaders with worker processes and random augmentation, stopped mid-epoch and resumed:
torch's DataLoader and torchdata's StatefulDataLoader give the uninterrupted run's bits
(leantrain's own DataLoader: ``test_map_style_loader.py``). A StatefulDataLoader with
workers is replayed as a torch loader: its saved state fast-forwards the sampler but not
the workers' generators, which drew other numbers after a resume, silently."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import leantrain as lt
from test_map_style_loader import Augmented

stateful = pytest.importorskip("torchdata.stateful_dataloader")
LOADERS = {"torch": torch.utils.data.DataLoader, "stateful": stateful.StatefulDataLoader}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("name", list(LOADERS))
def test_a_job_with_workers_and_augmentation_resumes_bit_for_bit(tmp_path, name, workers):
    def run(max_steps, resume=None):
        torch.manual_seed(0)
        runner = lt.Runner.from_module(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), "mse")
        loader = LOADERS[name](Augmented(), batch_size=4, shuffle=True, num_workers=workers)
        cfg = lt.LoaderTrainConfig(epochs=2, max_steps=max_steps, optimizer=lt.optim.adamw(0.01),
                                   checkpoint_path=tmp_path / f"c{max_steps}.ckpt", checkpoint_every=1,
                                   resume_from=resume, log_every=1)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            report, _ = lt.train_loader(runner, cfg, loader, log=None)
        return runner, report, [str(w.message) for w in said if not issubclass(w.category, DeprecationWarning)]

    whole, report, _ = run(12)
    run(8)  # stopped after 2 of the second epoch's 6 updates
    (tmp_path / "c8.ckpt").rename(tmp_path / "c12.ckpt")
    resumed, rest, said = run(12, resume=tmp_path / "c12.ckpt")
    assert said == []  # exact: nothing to warn about
    assert all(torch.equal(a, b) for a, b in zip(whole.module.state_dict().values(),
                                                 resumed.module.state_dict().values()))
    assert rest.losses == report.losses


@pytest.mark.parametrize("stop", [3, 7])  # mid-epoch in the first and second epoch (6 updates each)
def test_leantrains_worker_loader_resumes_a_model_that_draws_bit_for_bit(tmp_path, stop):
    """Starting an epoch's worker processes draws nothing from the global generator, so a
    resume (which starts one more set mid-epoch) leaves the model's dropout draws where the
    uninterrupted run has them."""
    def run(max_steps, resume=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 1))
        runner = lt.Runner.from_module(model, "mse")
        loader = lt.DataLoader(Augmented(), batch_size=4, shuffle=True, seed=3, num_workers=2)
        cfg = lt.LoaderTrainConfig(epochs=3, max_steps=max_steps, optimizer=lt.optim.adamw(0.01),
                                   checkpoint_path=tmp_path / f"c{max_steps}.ckpt", checkpoint_every=1,
                                   resume_from=resume, log_every=1)
        report, _ = lt.train_loader(runner, cfg, loader, log=None)
        return runner, report

    whole, report = run(10)
    run(stop)
    (tmp_path / f"c{stop}.ckpt").rename(tmp_path / "c10.ckpt")
    resumed, rest = run(10, resume=tmp_path / "c10.ckpt")
    assert all(torch.equal(a, b) for a, b in zip(whole.module.state_dict().values(),
                                                 resumed.module.state_dict().values()))
    assert rest.losses == report.losses


@pytest.mark.parametrize("make", ["torch", "leantrain"])
def test_a_resume_that_changes_whether_workers_read_says_the_draws_change(tmp_path, make):
    def run(workers, max_steps, resume=None):
        torch.manual_seed(0)
        runner = lt.Runner.from_module(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), "mse")
        loader = (torch.utils.data.DataLoader(Augmented(), batch_size=4, shuffle=True, num_workers=workers)
                  if make == "torch" else lt.DataLoader(Augmented(), batch_size=4, shuffle=True, seed=3,
                                                        num_workers=workers))
        cfg = lt.LoaderTrainConfig(epochs=2, max_steps=max_steps, optimizer=lt.optim.adamw(0.01), log_every=0,
                                   checkpoint_path=tmp_path / "c.ckpt", checkpoint_every=1, resume_from=resume)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            lt.train_loader(runner, cfg, loader, log=None)
        return [str(w.message) for w in said if "worker processes" in str(w.message)]

    assert run(0, 3) == []
    said = run(2, 8, resume=tmp_path / "c.ckpt")
    assert len(said) == 1 and "read without worker processes, this one reads with" in said[0]


class _DiesInAWorker(torch.utils.data.Dataset):
    """Item 9 kills the worker process that reads it (as the OOM killer would)."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        if i == 9 and torch.utils.data.get_worker_info() is not None:
            import os
            import signal
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.randn(4), torch.randn(1)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_killed_loader_worker_is_a_data_error_naming_the_last_checkpoint(tmp_path):
    runner = lt.Runner.from_module(nn.Linear(4, 1), "mse")
    loader = torch.utils.data.DataLoader(_DiesInAWorker(), batch_size=4, num_workers=2)
    cfg = lt.LoaderTrainConfig(epochs=1, log_every=0, measure_loss=False, checkpoint_path=tmp_path / "c.ckpt",
                               checkpoint_every=1)
    with pytest.raises(lt.DataError, match=r"a loader worker process died \(DataLoader worker .*\); last good "
                                           r"checkpoint: "):  # which update it surfaces at is torch's polling
        lt.train_loader(runner, cfg, loader)
