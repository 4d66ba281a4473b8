"""Accumulation that changes by epoch (Lightning's ``GradientAccumulationScheduler``):
``accumulate={0: 3, 2: 2, 3: 1}``, each epoch's groups of loader batches as the plain loop
takes them, exact and resumable (#54 item 8)."""

from __future__ import annotations

import copy

import pytest
import torch

import leantrain as lt
from leantrain import optim

SCHEDULE = {0: 3, 2: 2, 3: 1}


def _data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 3, generator=g), torch.randn(2, 1, generator=g)) for _ in range(14)]


def _cfg(**kw):
    return lt.LoaderTrainConfig(epochs=4, optimizer=optim.sgd(0.05), log_every=0, measure_loss=False,
                                accumulate=SCHEDULE, **kw)


def test_each_epoch_groups_its_batches_by_the_schedule():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    ref = copy.deepcopy(model)
    data = _data()  # 7 loader batches of 2 items an epoch
    report, _ = lt.train_loader(lt.Runner.from_module(model, "mse"), _cfg(), lt.DataLoader(data, batch_size=2),
                                log=None)
    batches = [data[i:i + 2] for i in range(0, 14, 2)]
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, fused=True)
    updates = 0
    for epoch in range(4):
        k = 3 if epoch < 2 else 2 if epoch == 2 else 1
        for start in range(0, 7, k):
            items = [s for b in batches[start:start + k] for s in b]
            opt.zero_grad()
            total = None
            for x, y in items:
                loss = torch.nn.functional.mse_loss(ref(x), y)
                total = loss if total is None else total + loss
            (total * (1.0 / len(items))).backward()
            opt.step()
            updates += 1
    assert report.steps == updates == 3 + 3 + 4 + 7
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # the item fold against one backward: rounding


@pytest.mark.parametrize("stop", [2, 5, 8])
def test_a_resume_under_an_accumulation_schedule_is_exact(tmp_path, stop):
    def run(**kw):
        torch.manual_seed(0)
        runner = lt.Runner.from_module(torch.nn.Linear(3, 1), "mse")
        loader = lt.DataLoader(_data(), batch_size=2, shuffle=True, seed=1)
        return runner, lt.train_loader(runner, _cfg(checkpoint_path=tmp_path / "c.ckpt", **kw), loader, log=None)[0]

    straight, full = run()
    (tmp_path / "c.ckpt").unlink()
    run(max_steps=stop)
    resumed, again = run(resume_from=tmp_path / "c.ckpt")
    assert again.steps == full.steps == 17
    assert all(torch.equal(a, b) for a, b in zip(straight.params.values(), resumed.params.values()))
    with pytest.raises(lt.LeantrainError, match="accumulate"):
        torch.manual_seed(0)
        lt.train_loader(lt.Runner.from_module(torch.nn.Linear(3, 1), "mse"),
                        lt.LoaderTrainConfig(epochs=4, optimizer=optim.sgd(0.05), log_every=0, accumulate={0: 2},
                                             resume_from=tmp_path / "c.ckpt", checkpoint_path=tmp_path / "c.ckpt"),
                        lt.DataLoader(_data(), batch_size=2, shuffle=True, seed=1), log=None)


@pytest.mark.parametrize("bad", [{}, {0: 0}, {-1: 2}, {0: 2.5}])
def test_a_bad_schedule_is_a_config_error(bad):
    with pytest.raises(lt.ConfigError, match="accumulate as a schedule"):
        lt.LoaderTrainConfig(epochs=1, accumulate=bad)
