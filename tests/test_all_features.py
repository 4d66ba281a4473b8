"""A checkpoint taken mid-run with clipping, per-slot hyperparameters, float16 autocast,
a moving average and loader accumulation all on resumes bit for bit in a fresh process."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import all_features as af
import leantrain as lt

HERE = Path(__file__).parent


@pytest.mark.parametrize("stop_at", [3, 5])
def test_everything_on_resumes_bit_for_bit_in_a_fresh_process(tmp_path, stop_at):
    runner, run, cfg = af.make()
    torch.set_num_threads(1)
    try:
        full = run(replace(cfg, checkpoint_path=tmp_path / "straight.ckpt"))
        _, run_mid, _ = af.make()
        run_mid(replace(cfg, checkpoint_path=tmp_path / "mid.ckpt"), lambda ev: ev.step == stop_at)
    finally:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    env = dict(os.environ, LEANTRAIN_THREADS="1", PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(HERE / "all_features.py"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    child = json.loads((tmp_path / "resumed.json").read_text())
    assert [tuple(x) for x in child["losses"]] == list(full.losses) and child["steps"] == full.steps
    assert [tuple(x) for x in child["grad_norms"]] == list(full.grad_norms) and len(full.grad_norms) == full.steps
    assert [[s, r] for s, r in full.evals] == child["evals"]
    a, b = load_file(str(tmp_path / "straight.ckpt")), load_file(str(tmp_path / "resumed.ckpt"))
    assert sorted(a) == sorted(b) and any(k.startswith("ema.") for k in a)
    for k in a:
        if not k.startswith("rng."):
            assert torch.equal(a[k], b[k]), k
    ma = lt.read_checkpoint(tmp_path / "straight.ckpt")[0]
    mb = lt.read_checkpoint(tmp_path / "resumed.ckpt")[0]
    assert ma["optimizer"] == mb["optimizer"] and ma["ema"] == mb["ema"] and ma["progress"] == mb["progress"]
    assert ma["optimizer"]["per_slot"] and ma["progress"]["autocast"] == "float16"
