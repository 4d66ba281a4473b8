"""A script torchrun starts that never calls ``init_process_group`` joins torchrun's job
(#66): leantrain initialises the default group from torchrun's environment, as the
command does, so its processes train one run (never N runs in one folder, the lock
blaming the job's own rank 1). An environment that names a world but not how to meet is
refused by name before anything changes."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import leantrain as lt

TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent))

SCRIPT = """
import json, os, sys, warnings
import torch
import torch.distributed as dist
import leantrain as lt

warnings.simplefilter("always")
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
g = torch.Generator().manual_seed(1)
xs = torch.randn(64, 4, generator=g)
data = [(xs[i], xs[i].sum().reshape(1)) for i in range(64)]
held = [(xs[i] + 0.5, xs[i].sum().reshape(1)) for i in range(16)]
cfg = lt.LoaderTrainConfig(epochs=4, optimizer=lt.optim.sgd(0.05), eval_data=held, eval_every=2, log_every=0,
                           checkpoint_path=sys.argv[1] + "/step{step}.ckpt", keep_best=2, load_best_at_end=True,
                           exact_reduction=True)
with warnings.catch_warnings(record=True) as caught:
    report, _ = lt.train_loader(lt.Runner.from_module(model, "mse"), cfg,
                                lt.DataLoader(data, batch_size=8, shuffle=True, seed=3, collate=lt.collate.items),
                                log=None,
                                callbacks=[lt.EarlyStopping(patience=2, min_delta=0.5)])
result = {"rank": dist.get_rank(), "world": dist.get_world_size(), "steps": report.steps,
          "best": report.best_checkpoint, "weights": [float(p.sum()) for p in model.parameters()],
          "warnings": [str(w.message) for w in caught]}
with open(os.path.join(sys.argv[2], f"result{dist.get_rank()}.json"), "w") as f:  # the ranks share one stdout
    json.dump(result, f)
"""


def test_a_world_without_a_meeting_point_is_refused_before_anything_changes(tmp_path, monkeypatch):
    torch.manual_seed(0)
    runner = lt.Runner.from_module(torch.nn.Linear(3, 1), "mse")
    before = [t.clone() for t in runner.params.values()]
    cfg = lt.TrainConfig(steps=2, checkpoint_path=tmp_path / "run" / "ck", log_every=0)
    samples = [(torch.randn(3), torch.randn(1)) for _ in range(4)]
    for k in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(lt.ConfigError, match=r"train_samples: WORLD_SIZE=2 .* RANK, MASTER_ADDR, MASTER_PORT is not "
                                             r"set .*init_process_group"):
        lt.train_samples(runner, cfg, samples, log=None)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(lt.ConfigError, match="WORLD_SIZE='two' in the environment is not a number"):
        lt.train_samples(runner, cfg, samples, log=None)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.params.values()))
    assert not (tmp_path / "run").exists() and not torch.distributed.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: nothing to join
    lt.train_samples(runner, cfg, samples, log=None)
    assert not torch.distributed.is_initialized()


@pytest.mark.slow
@pytest.mark.skipif(TORCHRUN is None, reason="no torchrun")
def test_torchrun_processes_without_a_group_train_one_run(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "2", str(script), str(tmp_path / "run"),
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in results] == [0, 1] and {r["world"] for r in results} == {2}
    assert results[0]["warnings"] == [] and results[1]["warnings"] == []
    a, b = results
    assert a["steps"] == b["steps"] < 32 and a["best"] == b["best"] and a["weights"] == b["weights"]
    assert Path(a["best"]).is_file()
    assert not (tmp_path / "run" / ".leantrain-run.json").exists()  # one lock, given back at the end
