"""``benchmarks/gpu.py --smoke``: every code path of the GPU benchmark on the CPU with a tiny
model (#71), so the script cannot rot between device loans. Its numbers mean nothing; what
is checked is that every section ran, wrote its row, and that the resume it checks is exact."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_gpu_benchmark_runs_every_section_on_the_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["device"] == "cpu (smoke)" and got["torch"]
    rows = got["rows"]
    assert [r for r in rows if "error" in r] == []
    assert {r["section"] for r in rows} == {"gpt", "syncs", "adamw", "hf", "resume", "sharding"}
    for r in rows:
        if "leantrain_s" in r:
            assert r["leantrain_s"] > 0 and r["reference_s"] > 0 and r["ratio_median"] > 0, r
    assert [r["what"].split(",")[0] for r in rows if r["section"] == "sharding" and "leantrain_s" in r] == \
        ["sharding='parameters'", "engine='fsdp2'"]
    (resume,) = [r for r in rows if r["section"] == "resume"]
    assert resume["exact"] and resume["differ_resume"] == 0 and resume["tensors"] > 10
    assert "GPT (smoke) update" in done.stdout and "exact resume" in done.stdout
