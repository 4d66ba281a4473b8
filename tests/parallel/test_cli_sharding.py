"""The command's sharding and pieces: ``--exact-reduction`` cuts each minibatch into a
fixed number of pieces, so 1, 2 and 3 processes (the last two sharded, ZeRO-2 and
ZeRO-1) write the same bits; a sharded run's checkpoint is a folder that resumes."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import leantrain as lt
from leantrain.cli.main import main

TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent))
ARGS = ["--max-steps", "8", "--log-every", "2", "--checkpoint-every", "4", "--exact-reduction", "--seed", "3"]


def state(out: Path) -> dict:
    tensors = lt.read_checkpoint(out / "checkpoint.ckpt")[1]
    return {k: t for k, t in tensors.items() if k.startswith(("storage.", "state."))}


def launch(out: Path, world: int, *extra: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if world == 1:
        command = [sys.executable, "-m", "leantrain", "train", *ARGS, *extra, "--out", str(out)]
    else:
        command = [TORCHRUN, "--standalone", "--nproc-per-node", str(world), "-m", "leantrain", "train", *ARGS,
                   *extra, "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(TORCHRUN is None, reason="no torchrun")
def test_exact_reduction_gives_the_same_bits_on_one_two_and_three_processes(tmp_path):
    launch(tmp_path / "one", 1)
    launch(tmp_path / "two", 2, "--sharding", "gradients")
    launch(tmp_path / "three", 3, "--sharding", "optimizer")
    one = state(tmp_path / "one")
    assert (tmp_path / "two" / "checkpoint.ckpt" / "index.json").is_file()  # a sharded run saves a folder
    for other in ("two", "three"):
        theirs = state(tmp_path / other)
        assert sorted(theirs) == sorted(one)
        for k in one:
            assert torch.equal(one[k], theirs[k]), (other, k)


def test_sharding_flags_are_checked(capsys):
    assert main(["train", "--sharding", "params", "--out", "x"]) == 2
    assert "--sharding: expected one of optimizer, gradients" in capsys.readouterr().err
    assert main(["train", "--shard-by", "block", "--out", "x"]) == 2
    assert "--shard-by: expected one of range, slot" in capsys.readouterr().err
    assert main(["train", "--pieces", "0", "--out", "x"]) == 2
    assert "--pieces" in capsys.readouterr().err


def test_a_sharded_command_run_resumes_and_overwrites(tmp_path, capsys):
    out = tmp_path / "run"
    base = ["train", "--max-steps", "4", "--checkpoint-every", "2", "--sharding", "optimizer", "--out", str(out)]
    assert main(base) == 0
    assert (out / "checkpoint.ckpt" / "index.json").is_file()
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0  # the run folder: its sharded checkpoint
    assert "sharded over 1 rank(s)" in capsys.readouterr().out
    assert main(["train", "--resume", str(out), "--max-steps", "6"]) == 0
    assert "steps: 6" in capsys.readouterr().out
    assert main(["train", "--max-steps", "2", "--out", str(out), "--overwrite"]) == 0  # unsharded: a file again
    assert (out / "checkpoint.ckpt").is_file()
