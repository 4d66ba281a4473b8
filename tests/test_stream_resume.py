"""Exact resume at any update of any epoch, in a fresh process, for every kind of loader
(tests/stream_cases.py): stopped by ``max_steps`` inside epochs 0, 1 and 2, resumed, the
parameters, buffers, optimizer state and logged losses equal the uninterrupted run's."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stream_cases import KINDS

HERE = Path(__file__).parent
STOPS = (2, 9, 17)  # epoch 0 batch 2, epoch 1 batch 2, epoch 2 batch 3 (7 batches an epoch)
SHARD_STOPS = (2, 5, 8)  # the same epochs for rank 0's half (3 full batches an epoch)
HAVE_TORCHDATA = importlib.util.find_spec("torchdata") is not None  # in the test extra
CASES = [f"{kind}@{stop}" for kind in KINDS for stop in (SHARD_STOPS if kind == "distributed" else STOPS)
         if HAVE_TORCHDATA or kind != "stateful"]


def _child(tmp, phase, cases):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(HERE / "stream_cases.py"), str(tmp), phase, *cases], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("streams")
    _child(tmp, "full", CASES)  # the uninterrupted runs, and the stopped ones
    _child(tmp, "resume", CASES)  # each resumed in another process
    return tmp


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_resume_equals_the_uninterrupted_run(runs, case):
    full = torch.load(runs / f"{case}.full.pt")
    resumed = torch.load(runs / f"{case}.resume.pt")
    assert resumed["steps"] == full["steps"] == (9 if case.startswith("distributed") else 21)
    assert resumed["losses"] == full["losses"]
    for k, v in full["module"].items():
        assert torch.equal(resumed["module"][k], v), k
    assert full["records"].keys() == resumed["records"].keys()
    for i, rec in full["records"].items():
        for name, t in rec.items():
            assert torch.equal(resumed["records"][i][name], t), (i, name)
    kind = case.partition("@")[0]
    if kind == "plain_iterable":  # no position to save: read again and dropped, and said so
        assert len(resumed["warnings"]) == 1 and "no position to save" in resumed["warnings"][0]
    else:
        assert resumed["warnings"] == []
