"""Data parallel training on torch.distributed (gloo, 2 processes on this machine)."""

import torch
import pytest
from safetensors import safe_open

import spawning
import dist_cases as dc
from leantrain.training.parallel import distributed

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")


def tensors(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if k.startswith(("storage.", "state."))}


def spawn(tmp, plan, tag):
    spawning.spawn(dc.worker, (2, str(tmp / f"init-{tag}"), str(tmp), plan), 2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    torch.set_num_threads(1)
    # world size 2: straight runs, and runs stopped after STOP updates
    spawn(tmp, [(c, "w2", False, False) for c in dc.CASES] + [(c, "x", False, True) for c in dc.CASES], "a")
    for case in dc.CASES:
        dc.run(case, tmp, "w1")  # the reference, world size 1
        dc.run(case, tmp, "w2to1", resume=True)  # resume a world-size-2 checkpoint here
        dc.run(case, tmp, "y", stop=True)  # stop a world-size-1 run (overwrites .stopped)
    spawn(tmp, [(c, "w1to2", True, False) for c in dc.CASES], "b")  # and resume it on 2 ranks
    return tmp


def close(case, a, b):
    tol = 1e-12 if "f64" in case else 1e-6
    ta, tb = tensors(a), tensors(b)
    assert sorted(ta) == sorted(tb)
    for k in ta:
        torch.testing.assert_close(ta[k], tb[k], rtol=tol, atol=tol, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("case", dc.CASES)
def test_world_size_2_equals_world_size_1(case, runs):
    close(case, runs / f"{case}.w1", runs / f"{case}.w2")


@pytest.mark.parametrize("case", dc.CASES)
def test_resume_across_world_sizes(case, runs):
    close(case, runs / f"{case}.w1", runs / f"{case}.w2to1")
    close(case, runs / f"{case}.w1", runs / f"{case}.w1to2")


def test_round_robin_split_rule():
    assert distributed.my_items(list(range(7)), 0, 2) == [0, 2, 4, 6]
    assert distributed.my_items(list(range(7)), 1, 2) == [1, 3, 5]
    assert distributed.my_items([0], 1, 2) == []
    assert distributed.active() is None and distributed.is_main()


@pytest.mark.slow
def test_torchrun_runs_the_train_command(tmp_path):
    import json
    import shutil
    import subprocess
    import sys

    torchrun = shutil.which("torchrun", path=str(__import__("pathlib").Path(sys.executable).parent))
    assert torchrun is not None
    out = tmp_path / "run"
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "leantrain", "train",
         "--epochs", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("leantrain train:") == 1  # rank 0 alone prints
    assert "2 processes" in proc.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 90 and report["test_accuracy"] > 0.8
