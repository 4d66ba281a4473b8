"""``engine="ddp"``: torch's DistributedDataParallel reduces the gradients, leantrain keeps
the loop's contract (#69). On 2 and 3 gloo ranks (``engine_cases.py``) every case ends
where the one-process leantrain run ends (rtol 1e-5: each rank sums its items first, so
the bits across world sizes are given up), every rank alike, the user's module as it was
(its ties, no ``.grad`` left by the run, no DDP hook), the same run twice bit for bit, a
``"ddp"`` checkpoint continued by one process and by 3 ranks."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import engine_cases as cases
import leantrain as lt
import spawning

pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed"),
              pytest.mark.slow]

WORLDS = (2, 3)
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    out = tmp_path_factory.mktemp("engines")
    for world in WORLDS:
        spawning.spawn(cases.worker, (world, str(out / f"init{world}"), str(out)), world)
    return out


def load(out: Path, world: int, name: str) -> list:
    return [torch.load(out / str(world) / f"{name}.{r}.pt", weights_only=False) for r in range(world)]


def close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if a[k].is_floating_point():
            torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{k}: {m}")
        else:
            assert torch.equal(a[k], b[k]), k


def same_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", list(cases.CASES))
def test_ddp_ends_where_one_process_ends(table, name, world):
    ref = cases.ended(*cases.run(name, 1))
    ranks = load(table, world, name)
    if name == "unused_found":  # the unused layer: no gradient, no update (torch's rule), on every rank
        start = cases.CASES[name][0]().state_dict()
        assert all(torch.equal(ranks[0]["state"][k], start[k]) for k in ("unused.weight", "unused.bias"))
    for r, got in enumerate(ranks):
        same_bits(got["state"], ranks[0]["state"])  # every rank holds the same values
        assert got["tied"] and got["steps"] == cases.STEPS
        assert all(g is None for g in got["grads"]), f"rank {r}: the run left .grad on the user's Parameters"
    close(ranks[0]["state"], ref["state"])
    for (s, loss), (s_ref, loss_ref) in zip(ranks[0]["losses"], ref["losses"]):
        assert s == s_ref and loss == pytest.approx(loss_ref, rel=1e-5)


@pytest.mark.parametrize("world", WORLDS)
def test_an_unused_parameter_without_find_unused_parameters_is_refused_by_name(table, world):
    for r in load(table, world, "unused_refused"):
        assert r["message"].startswith("engine='ddp': a trainable parameter got no gradient"), r["message"]
        assert "leantrain.DDP(find_unused_parameters=True)" in r["message"]


@pytest.mark.parametrize("world", WORLDS)
def test_the_row_hint_is_said_once_by_rank_0(table, world):
    said = [r["said"] for r in load(table, world, "row_hint")]
    assert len(said[0]) == 1 and "collate=leantrain.collate.stack" in said[0][0]
    assert all(s == [] for s in said[1:])


def test_frozen_slots_stay_as_they_were(table):
    start = cases.CASES["frozen_backbone"][0]().state_dict()
    for world in WORLDS:
        got = load(table, world, "frozen_backbone")[0]["state"]
        frozen = [k for k in got if k.startswith("backbone.") and "running" not in k and "num_batches" not in k]
        assert frozen and all(torch.equal(got[k], start[k]) for k in frozen)


@pytest.mark.parametrize("world", WORLDS)
def test_the_same_run_twice_gives_the_same_bits(table, world):
    same_bits(load(table, world, "repeat")[0]["state"], load(table, world, "gpt")[0]["state"])


@pytest.mark.parametrize("world", WORLDS)
def test_evaluations_are_the_jobs(table, world):
    ref = cases.ended(*cases.run("cnn_batchnorm", 1, eval_data=cases.CASES["cnn_batchnorm"][1][:5], eval_every=2))
    ranks = load(table, world, "eval")
    assert [s for s, _ in ranks[0]["evals"]] == [s for s, _ in ref["evals"]] == [2, 4]
    assert all(r["evals"] == ranks[0]["evals"] for r in ranks)
    for (_, mine), (_, theirs) in zip(ranks[0]["evals"], ref["evals"]):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)


@pytest.mark.parametrize("world", WORLDS)
def test_ten_loops_in_a_row_in_one_process_end_on_every_rank(table, world):
    """Each loop's process group was torn down while a peer still read the last message
    (a SIGABRT in about half of such runs); every rank now passes a barrier first."""
    assert [r["loops"] for r in load(table, world, "loops")] == [10] * world


def test_a_ddp_checkpoint_resumes_in_one_process_and_on_three_ranks(table):
    ref = cases.ended(*cases.run("gpt", 1))
    one = cases.ended(*cases.run("gpt", 1, resume_from=str(table / "after2.ckpt")))
    close(one["state"], ref["state"])
    for got in load(table, 3, "resumed"):
        close(got["state"], ref["state"])


def test_a_peer_lost_in_ddps_all_reduce_is_a_collective_error_naming_rank_update_and_checkpoint(tmp_path):
    child = Path(__file__).parent / "ddp_lost_peer_child.py"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(child), str(r), str(tmp_path / "init"), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    try:
        out, err = procs[0].communicate(timeout=120)
    finally:
        procs[1].kill()
        procs[1].communicate(timeout=60)
    assert procs[0].returncode == 3, err[-2000:]
    assert out.startswith("CollectiveError | train_samples: rank 0 of 2, update 4: a collective operation failed "
                          "(DDP's gradient all-reduce"), out
    assert f"last good checkpoint: {tmp_path / 'run.ckpt'} (step 3)" in out


TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent))
ARGS = ["--max-steps", "6", "--log-every", "2", "--checkpoint-every", "3", "--pieces", "2", "--seed", "3"]


def command(out: Path, world: int, *extra: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    head = [sys.executable, "-m", "leantrain"] if world == 1 else \
        [TORCHRUN, "--standalone", "--nproc-per-node", str(world), "-m", "leantrain"]
    proc = subprocess.run([*head, "train", *ARGS, *extra, "--out", str(out)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def storages(path: Path) -> dict:
    return {k: t for k, t in lt.read_checkpoint(path)[1].items() if k.startswith("storage.")}


@pytest.mark.skipif(TORCHRUN is None, reason="no torchrun")
def test_the_command_with_engine_ddp_under_torchrun(tmp_path):
    """``--engine ddp`` on the digits preset, 2 processes: the one-process run's values
    (rtol 1e-5), a checkpoint the plain command resumes, ``export --dcp`` of it."""
    command(tmp_path / "one", 1)
    console = command(tmp_path / "ddp", 2, "--engine", "ddp")
    assert "2 processes, engine ddp (torch's all-reduce: not the bits of one process)" in console
    assert json.loads((tmp_path / "ddp" / "config.json").read_text())["engine"] == "ddp"  # what a resume reads
    one, ddp = storages(tmp_path / "one" / "checkpoint.ckpt"), storages(tmp_path / "ddp" / "checkpoint.ckpt")
    assert sorted(one) == sorted(ddp)
    for k in one:
        torch.testing.assert_close(ddp[k], one[k], rtol=RTOL, atol=ATOL)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    resumed = subprocess.run([sys.executable, "-m", "leantrain", "train", "--resume", str(tmp_path / "ddp"),
                              "--max-steps", "8"], capture_output=True, text=True, timeout=300, env=env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert lt.read_checkpoint(tmp_path / "ddp" / "checkpoint.ckpt")[0]["progress"]["step"] == 8
    exported = subprocess.run([sys.executable, "-m", "leantrain", "export", str(tmp_path / "ddp"), "--dcp", "-o",
                               str(tmp_path / "dcp")], capture_output=True, text=True, timeout=300, env=env)
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert (tmp_path / "dcp" / ".metadata").is_file()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="engine='ddp' over NCCL needs two CUDA devices")
def test_ddp_over_nccl_ends_where_one_device_ends(tmp_path):
    spawning.spawn(cases.cuda_worker, (2, str(tmp_path / "init"), str(tmp_path)), 2)
    ref = cases.ended(*cases.cuda_run("gpt", torch.device("cuda", 0)))
    for r in range(2):
        got = torch.load(tmp_path / f"cuda.{r}.pt", weights_only=False)
        assert got["tied"]
        close({k: v.cpu() for k, v in got["state"].items()}, {k: v.cpu() for k, v in ref["state"].items()})
