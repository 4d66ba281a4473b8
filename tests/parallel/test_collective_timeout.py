"""A stopped or hung rank is an error on the others within ``collective_timeout``, not a
30-minute hang: CollectiveError names the rank and the step, and the last checkpoint
stays intact. Rank 1 stops itself at an explicit point (after update 3)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import leantrain as lt
import spawning

WORKER = """
import os, signal, sys, threading
import torch, torch.distributed as dist, torch.nn as nn
import leantrain as lt
rank, init, out, how = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=2)
torch.manual_seed(0)
drop = [nn.Dropout(0.1)] if how == "killed-parameters" else []  # forwards that replay draws on every rank
runner = lt.Runner.from_module(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), *drop, nn.Linear(4, 1)), "mse")
g = torch.Generator().manual_seed(1)
data = [(torch.randn(3, generator=g), torch.randn(1, generator=g)) for _ in range(8)]

def stop_at_3(ev):
    if rank == 1 and ev.step == 3 + (how in ("killed-parameters", "hung-gradients")):  # after update 4: checkpoint 3 kept
        open(os.path.join(out, "rank1.pid"), "w").write(str(os.getpid()))
        if how == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if how == "killed-parameters":
            os.kill(os.getpid(), signal.SIGKILL)  # dead: the survivor's next gather finds no peer
        threading.Event().wait()  # hung: never returns

cfg = lt.TrainConfig(steps=10, batch_size=4, log_every=0, checkpoint_every=3, collective_timeout=3,
                     checkpoint_path=os.path.join(out, "run.ckpt"),
                     sharding={"killed-parameters": "parameters", "hung-gradients": "gradients"}.get(how))
try:
    lt.train_samples(runner, cfg, data, callback=stop_at_3)
except lt.LeantrainError as e:
    print(type(e).__name__, "|", e, flush=True)
    os._exit(3)
print("finished", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigstop", "hung", "killed-parameters", "hung-gradients"])
def test_a_stopped_rank_is_a_collective_error_in_seconds(tmp_path, how):
    """``killed-parameters``: rank 1 dies under ``sharding="parameters"``; the survivor's
    gather inside the model's forward is a ``CollectiveError`` too (it was reported as the
    user's bad sample), its message naming the rank, the update and the checkpoint.
    ``hung-gradients``: under ``sharding="gradients"`` the survivor's first wait is on the
    reduce-scatter's point-to-point transfers, which end at the timeout too."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    code, out, err = spawning.rank_0_of_two(script, str(tmp_path / "init"), str(tmp_path), how)
    assert code == 3, err[-2000:]
    # rank 1 stops inside its step callback after update 3 (4): rank 0 meets the loss at the job's decision to stop,
    # the one collective after each update whose callback may stop the run (#66), not one update later
    update = 4 if how in ("killed-parameters", "hung-gradients") else 3
    assert out.startswith(f"CollectiveError | train_samples: rank 0 of 2, after update {update} (the job's decision "
                          f"to stop, on_step): a collective operation failed"), out
    assert f"last good checkpoint: {tmp_path / 'run.ckpt'} (step 3)" in out
    runner = lt.Runner.from_module(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)),
                                   "mse")
    if how in ("killed-parameters", "hung-gradients"):
        return  # a sharded folder: its resume is tested with the sharding tests
    ck = lt.load_checkpoint(tmp_path / "run.ckpt", runner)
    assert ck.progress["step"] == 3 and ck.state.steps == 3


TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent))
HANGER = """
import os, sys, threading
from leantrain.training.loops import session

update = session.Session.update

def hanging(self, state, batch, step):
    if step == 13 and os.environ.get("RANK") == "1":  # updates are numbered from 1
        threading.Event().wait()  # rank 1 stops answering
    return update(self, state, batch, step)

session.Session.update = hanging
from leantrain.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.skipif(TORCHRUN is None, reason="no torchrun")
def test_the_command_takes_a_collective_timeout(tmp_path):
    script = tmp_path / "hanger.py"
    script.write_text(HANGER)
    out = tmp_path / "run"
    proc = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc-per-node", "2", str(script), "train", "--epochs", "1",
         "--checkpoint-every", "10", "--log-every", "0", "--collective-timeout", "3", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode != 0
    assert "error: train_loader: rank 0 of 2, update 13: a collective operation failed" in proc.stderr, proc.stderr[-3000:]
    assert f"last good checkpoint: {out / 'checkpoint.ckpt'} (step 10)" in proc.stderr
    assert "Traceback" not in proc.stderr.split("error: train_loader: rank 0")[0][-500:]
    lt.read_checkpoint(out / "checkpoint.ckpt")  # intact


def test_the_timeout_is_validated():
    for bad in (0, -1, float("inf"), float("nan"), "5", True):
        with pytest.raises(lt.ConfigError, match="collective_timeout"):
            lt.TrainConfig(steps=1, collective_timeout=bad)
    assert lt.TrainConfig(steps=1, collective_timeout=None).collective_timeout is None
