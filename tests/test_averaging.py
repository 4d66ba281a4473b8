"""``averaging=lt.Averaging(AveragedModel(...))``: torch's averaged models driven by a loop
(every N updates from update K: SWA's start, torchvision's EMA is in
test_torchvision_recipe.py), kept in checkpoints, refused where it cannot run."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.optim import swa_utils

import leantrain as lt
from leantrain import optim


def _data(n=10):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 3, generator=g), torch.randn(2, 1, generator=g)) for _ in range(n)]


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))


@pytest.mark.parametrize("every, start", [(1, 1), (3, 4), (2, 5)])
def test_swa_every_n_updates_from_update_k_is_torchs_averaged_model(every, start):
    """SWA (the plain running mean, buffers kept in sync) as a hand loop runs it."""
    model, data = _net(), _data()
    ref = copy.deepcopy(model)
    swa = swa_utils.AveragedModel(model)
    lt.train_samples(lt.Runner.from_module(model, "mse"),
                     lt.TrainConfig(steps=10, optimizer=optim.sgd(0.05), log_every=0, measure_loss=False,
                                    averaging=lt.Averaging(swa, every=every, start=start)), data, log=None)
    theirs = swa_utils.AveragedModel(ref)
    torch_opt = torch.optim.SGD(ref.parameters(), lr=0.05, fused=True)
    for k, (x, y) in enumerate(data, start=1):
        torch_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        torch_opt.step()
        if k >= start and (k - start) % every == 0:
            theirs.update_parameters(ref)
    assert swa.n_averaged.item() == theirs.n_averaged.item() > 0
    assert all(torch.equal(a, b) for a, b in zip(swa.state_dict().values(), theirs.state_dict().values()))


def test_an_averaged_model_resumes_from_its_checkpoint(tmp_path):
    def run(steps, resume=None):
        model = _net()
        avg = swa_utils.AveragedModel(model, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.9), use_buffers=True)
        cfg = lt.TrainConfig(steps=steps, optimizer=optim.adam(0.01), log_every=0, measure_loss=False,
                             checkpoint_path=tmp_path / "a.ckpt", checkpoint_every=1, resume_from=resume,
                             averaging=lt.Averaging(avg, every=2))
        lt.train_samples(lt.Runner.from_module(model, "mse"), cfg, _data(), log=None)
        return avg

    straight = run(10)
    (tmp_path / "a.ckpt").unlink()
    run(5)
    resumed = run(10, resume=tmp_path / "a.ckpt")
    assert all(torch.equal(a, b) for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()))


@pytest.mark.parametrize("make, message", [
    (lambda m: lt.Averaging(m), "must be a torch.optim.swa_utils.AveragedModel"),
    (lambda m: lt.Averaging(swa_utils.AveragedModel(torch.nn.Linear(2, 2))), "does not average the trained module"),
    (lambda m: lt.Averaging(swa_utils.AveragedModel(m), every=0), "every"),
    (lambda m: lt.Averaging(swa_utils.AveragedModel(m), per_epoch=True), "per_epoch=True counts updates"),
])
def test_bad_averaging_is_refused_before_anything_changes(make, message):
    model = _net()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(lt.ConfigError, match=message):
        lt.train_samples(lt.Runner.from_module(model, "mse"),
                         lt.TrainConfig(steps=2, optimizer=optim.sgd(0.1), log_every=0, averaging=make(model)),
                         _data(), log=None)
    assert all(torch.equal(a, b) for a, b in zip(before.values(), model.state_dict().values()))


def test_a_checkpoint_without_an_averaged_model_does_not_resume_a_run_with_one(tmp_path):
    model = _net()
    lt.train_samples(lt.Runner.from_module(model, "mse"),
                     lt.TrainConfig(steps=2, optimizer=optim.sgd(0.1), log_every=0, checkpoint_path=tmp_path / "c.ckpt"),
                     _data(), log=None)
    with pytest.raises(lt.LeantrainError, match="keeps no averaged model"):
        lt.train_samples(lt.Runner.from_module(_net(), "mse"),
                         lt.TrainConfig(steps=4, optimizer=optim.sgd(0.1), log_every=0, resume_from=tmp_path / "c.ckpt",
                                        averaging=lt.Averaging(swa_utils.AveragedModel(model))), _data(), log=None)


def test_swa_as_torchs_swa_utils_loop_runs_it():
    """torch's SWA recipe: a cosine schedule then SWALR from epoch 2 (SequentialLR), the
    average updated at the end of each epoch from there, BatchNorm statistics recomputed
    with ``update_bn`` after training: the same averaged model."""
    from leantrain.optim import lr_scheduler as L

    def loader():
        return torch.utils.data.DataLoader(list(zip(*[torch.cat(t) for t in zip(*_data(8))])), batch_size=4,
                                           shuffle=True)

    def schedule(module, opt):
        swalr = swa_utils.SWALR if module is torch.optim.lr_scheduler else module.SWALR
        return module.SequentialLR(opt, [module.CosineAnnealingLR(opt, T_max=5), swalr(opt, swa_lr=0.02)],
                                   milestones=[2])

    torch.manual_seed(3)
    model, spe = _net(), 4
    ref = copy.deepcopy(model)
    theirs = swa_utils.AveragedModel(ref)
    torch_opt = torch.optim.SGD(ref.parameters(), lr=0.1, fused=True)
    sched = schedule(torch.optim.lr_scheduler, torch_opt)
    train = loader()
    torch.manual_seed(4)
    for epoch in range(5):
        for x, y in train:
            torch_opt.zero_grad()
            torch.nn.functional.mse_loss(ref(x), y).backward()
            torch_opt.step()
        if epoch >= 2:
            theirs.update_parameters(ref)
        sched.step()
    swa_utils.update_bn(train, theirs)

    swa = swa_utils.AveragedModel(model)
    opt = optim.sgd(0.1)
    ours = loader()
    torch.manual_seed(4)
    lt.train_loader(lt.Runner.from_module(model, "mse"),
                    lt.LoaderTrainConfig(epochs=5, optimizer=opt, scheduler=schedule(L, opt), log_every=0,
                                         measure_loss=False, averaging=lt.Averaging(swa, every=spe, start=3 * spe)),
                    ours, log=None)
    swa_utils.update_bn(ours, swa)
    assert all(torch.equal(a, b) for a, b in zip(swa.state_dict().values(), theirs.state_dict().values()))
