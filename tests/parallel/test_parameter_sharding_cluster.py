"""Parameter sharding from the command under torchrun: rank 1 killed mid-run (SIGKILL just
before update 25), the same command launched again resumes from the last checkpoint (the
sharded folder) and ends bit-identical to the uninterrupted run; and that run has the bits
of one process without sharding (parameter sharding folds every item in item order)."""

import os
import subprocess
import sys

import pytest
import torch

import leantrain as lt
from test_cluster import ARGS, TORCHRUN, killed_and_relaunched

SHARDED = [*ARGS, "--sharding", "parameters"]


def tensors(folder):
    return {k: t for k, t in lt.read_checkpoint(folder / "checkpoint.ckpt")[1].items()
            if k.startswith(("storage.", "state.", "loader."))}


def assert_same_run(a, b):
    ta, tb = tensors(a), tensors(b)
    assert sorted(ta) == sorted(tb) and any(k.startswith("storage.") for k in ta)
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


@pytest.mark.slow
@pytest.mark.skipif(TORCHRUN is None, reason="no torchrun")
def test_a_killed_rank_of_a_parameter_sharded_run_resumes_bit_identically(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", CRASH_ONCE=str(tmp_path / "crashed"))
    straight = tmp_path / "straight"
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "leantrain", "train", *SHARDED,
                           "--out", str(straight)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (straight / "checkpoint.ckpt" / "index.json").is_file()
    one = tmp_path / "one"
    proc = subprocess.run([sys.executable, "-m", "leantrain", "train", *ARGS, "--pieces", "2", "--out", str(one)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_run(straight, one)  # two items per update, one per rank: one process's bits
    killed_and_relaunched(tmp_path, SHARDED, tmp_path / "restarted")
    assert_same_run(straight, tmp_path / "restarted")
