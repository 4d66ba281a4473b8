"""The batch-size finder (#54 item 7): doubling trials on a copy of the model, each trial's
peak memory against the budget, the model, its optimizer state and every generator left
as they were; the command's ``find-batch-size``."""

from __future__ import annotations

import json
import random

import numpy
import pytest
import torch

import leantrain as lt
from leantrain import optim
from leantrain.cli.main import main


def _runner():
    torch.manual_seed(0)
    return lt.Runner.from_module(torch.nn.Sequential(torch.nn.Linear(64, 4096), torch.nn.ReLU(),
                                                     torch.nn.Linear(4096, 1)), "mse")


def _make_loader(size):
    g = torch.Generator().manual_seed(1)
    items = [(torch.randn(64, generator=g), torch.randn(1, generator=g)) for _ in range(4096)]
    return lt.DataLoader(items, batch_size=size, shuffle=True, seed=0, collate=torch.utils.data.default_collate)


def test_doubling_stops_at_the_first_batch_over_the_budget_and_changes_nothing():
    runner = _runner()
    before = [p.detach().clone() for p in runner.module.parameters()]
    torch.manual_seed(5), random.seed(5), numpy.random.seed(5)
    rng = torch.get_rng_state(), random.getstate(), numpy.random.get_state()[1].copy()
    wide = lt.find_batch_size(runner, _make_loader, optim.adam(1e-3), max_batch_size=64, memory_budget=2**40)
    assert wide.batch_size == 64 and [b for b, _, _ in wide.trials] == [1, 2, 4, 8, 16, 32, 64]
    assert all(f and p > 0 for _, p, f in wide.trials)
    budget = wide.trials[-1][1] + 40 * 2**20  # room over batch 64's peak for a little more, not for 4096 rows x 4096 (tensors over glibc's mmap bound: fresh pages, whatever the process freed before)
    found = lt.find_batch_size(runner, _make_loader, optim.adam(1e-3), start=64, memory_budget=budget)
    fits = [b for b, _, f in found.trials if f]
    assert found.batch_size == max(fits) and not found.trials[-1][2] and found.trials[-1][1] > budget
    assert all(p <= budget for _, p, f in found.trials if f)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.module.parameters()))
    assert torch.equal(torch.get_rng_state(), rng[0]) and random.getstate() == rng[1]
    assert (numpy.random.get_state()[1] == rng[2]).all()
    whole = lt.find_batch_size(runner, _make_loader, optim.sgd(0.1), start=1024, memory_budget=2**40)
    assert whole.batch_size == 4096 and [b for b, _, _ in whole.trials] == [1024, 2048, 4096]  # all the data
    none = lt.find_batch_size(runner, _make_loader, optim.adam(1e-3), memory_budget=1)
    assert none.batch_size is None and len(none.trials) == 1


@pytest.mark.parametrize("kw, message", [
    ({}, "give memory_budget"), ({"memory_budget": -1}, "memory_budget"), ({"memory_budget": 1, "start": 0}, "start"),
    ({"memory_budget": 1, "max_steps": 3}, "the finder's own"),
])
def test_bad_finder_arguments_are_config_errors(kw, message):
    with pytest.raises(lt.ConfigError, match=message):
        lt.find_batch_size(_runner(), _make_loader, optim.sgd(0.1), **kw)


def test_the_command_writes_the_largest_batch_that_fits(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["find-batch-size", "--memory-budget", str(2**20), "--max-batch-size", "16", "--out", str(out)]) == 0
    record = json.loads((out / "batch_size.json").read_text())
    assert record["batch_size"] == 16 and [t["batch_size"] for t in record["trials"]] == [1, 2, 4, 8, 16]
    assert "train with --batch-size 16" in capsys.readouterr().out
