"""Every pass that promises to change nothing restores every global generator a collate or
transform draws from (torch's, Python's ``random``, NumPy's), and checkpoints carry
Python's and NumPy's states with torch's, so a resume draws what the straight run draws
(#56 items 2 and 3)."""

from __future__ import annotations

import random

import numpy
import pytest
import torch

import leantrain as lt
from leantrain import optim


def _drawing_collate(batch):
    """A collate that draws from Python's and NumPy's global generators (augmentations)."""
    x = torch.stack([b[0] for b in batch]) * (1 + random.random() + float(numpy.random.rand()))
    return x, torch.stack([b[1] for b in batch])


def _loader():
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(3, generator=g), torch.randn(1, generator=g)) for _ in range(12)]
    return torch.utils.data.DataLoader(data, batch_size=3, shuffle=True, collate_fn=_drawing_collate)


def _states():
    return random.getstate(), numpy.random.get_state()[1].tolist(), torch.get_rng_state().tolist()


def test_evaluate_and_the_measuring_passes_put_every_generator_back():
    torch.manual_seed(0), random.seed(0), numpy.random.seed(0)
    runner = lt.Runner.from_module(torch.nn.Linear(3, 1), "mse")
    before = _states()
    lt.evaluate(runner, _loader())
    assert _states() == before
    lt.evaluate(runner, _loader(), draws="advance")
    assert _states() != before  # the hand-written loop's: the collate and the iterator drew


def test_the_before_and_after_passes_leave_the_training_draws_alone():
    """measure_loss=True reads the loader twice more; the updates draw what they draw without."""
    def run(measure):
        torch.manual_seed(1), random.seed(1), numpy.random.seed(1)
        torch.manual_seed(1)
        model = torch.nn.Linear(3, 1)
        lt.train_loader(lt.Runner.from_module(model, "mse"),
                        lt.LoaderTrainConfig(epochs=2, optimizer=optim.sgd(0.1), log_every=0, measure_loss=measure),
                        _loader(), log=None)
        return model.weight.detach().clone()

    assert torch.equal(run(True), run(False))


@pytest.mark.parametrize("stop", [2, 4, 5])
def test_a_resume_draws_what_the_straight_run_draws(tmp_path, stop):
    """Killed after update ``stop`` and resumed with every generator scrambled: Python's and
    NumPy's states come back from the checkpoint (4 updates an epoch)."""
    def cfg(path, **kw):
        return lt.LoaderTrainConfig(epochs=2, optimizer=optim.adam(0.01), log_every=0, measure_loss=False,
                                    checkpoint_path=path, **kw)

    def fresh():
        torch.manual_seed(2), random.seed(2), numpy.random.seed(2)
        torch.manual_seed(2)
        return torch.nn.Linear(3, 1)

    straight = fresh()
    lt.train_loader(lt.Runner.from_module(straight, "mse"), cfg(tmp_path / "s.ckpt"), _loader(), log=None)
    first = fresh()
    lt.train_loader(lt.Runner.from_module(first, "mse"), cfg(tmp_path / "r.ckpt", max_steps=stop), _loader(),
                    log=None)
    resumed = fresh()
    random.seed(99), numpy.random.seed(99), torch.manual_seed(99)  # another process's generators
    lt.train_loader(lt.Runner.from_module(resumed, "mse"), cfg(tmp_path / "r.ckpt", resume_from=tmp_path / "r.ckpt"),
                    _loader(), log=None)
    assert torch.equal(resumed.weight, straight.weight) and torch.equal(resumed.bias, straight.bias)


def test_a_checkpoint_holds_pythons_and_numpys_states(tmp_path):
    runner = lt.Runner.from_module(torch.nn.Linear(2, 1), "mse")
    random.seed(5), numpy.random.seed(5)
    random.random(), numpy.random.rand()
    want = random.getstate(), numpy.random.get_state()
    lt.save_checkpoint(tmp_path / "c.ckpt", runner)
    random.seed(6), numpy.random.seed(6)
    lt.load_checkpoint(tmp_path / "c.ckpt", runner)
    got = random.getstate(), numpy.random.get_state()
    assert got[0] == want[0]
    assert (got[1][1] == want[1][1]).all() and got[1][2:] == want[1][2:]
