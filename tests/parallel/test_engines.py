"""``engine="ddp"`` (torch's DistributedDataParallel reduces the gradients) and
``engine="fsdp2"`` (torch's fully_shard runs the items on a sharded copy, leantrain's
optimizer steps the shards): leantrain keeps the loop's contract (#69). On 2 and 3 gloo
ranks (``engine_cases.py``) every case ends where the one-process leantrain run ends (rtol
1e-5: each rank sums its items first, so the bits across world sizes are given up), every
rank alike, the user's module as it was (its ties, no ``.grad`` left by the run, no hook),
the same run twice bit for bit, checkpoints continued across engines and world sizes. The
cases include leantrain's autocast (bfloat16, and float16 with its loss scaling) and a NaN
item's update skipped (``nonfinite="skip"``: FSDP2's shards and state kept)."""

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


ROWS = [("ddp", name) for name in cases.CASES if name not in cases.FSDP2_ONLY] + \
    [("fsdp2", name) for name in cases.FSDP2_CASES if name != "bfloat16"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("engine,name", ROWS)
def test_a_torch_engine_ends_where_one_process_ends(table, engine, name, world):
    ref = cases.ended(*cases.run(name, 1))
    ranks = load(table, world, f"{engine}-{name}")
    if name == "unused_found":  # the unused layer: no gradient, no update (torch's rule), on every rank
        start = cases.CASES[name][0]().state_dict()
        assert all(torch.equal(ranks[0]["state"][k], start[k]) for k in ("unused.weight", "unused.bias"))
    for r, got in enumerate(ranks):
        same_bits(got["state"], ranks[0]["state"])  # every rank holds the same values
        assert got["tied"] and got["steps"] == cases.STEPS
        assert all(g is None for g in got["grads"]), f"rank {r}: the run left .grad on the user's Parameters"
    close(ranks[0]["state"], ref["state"])
    for (s, loss), (s_ref, loss_ref) in zip(ranks[0]["losses"], ref["losses"]):
        assert s == s_ref and loss == pytest.approx(loss_ref, rel=1e-5, nan_ok=True)  # a skipped update's NaN


@pytest.mark.parametrize("kind,world", [("ddp", 2), ("ddp", 3), ("ddp_unused", 3), ("fsdp2", 2), ("fsdp2", 3)])
def test_a_run_stopped_inside_an_epoch_resumes_to_the_straight_runs_bits_or_says_why_not(table, kind, world):
    """A shuffling loader of 3-item batches (uneven on 2 ranks), the tied GPT with dropout,
    stopped after update 5 of 8 and resumed at the same world size: every value and loss of
    the straight run, bit for bit (the loader's place, the generators and the state all
    restored). But DDP on 3 ranks: its first update in a run reduces one bucket in the
    parameters' order, later ones the buckets it rebuilt in the backward's order, and on 3
    ranks the all-reduce's order of addition follows an element's place in its bucket (on 2,
    a + b is b + a): the resumed run is within rounding and says why, naming
    ``find_unused_parameters=True``, which keeps one layout (bit for bit, checked)."""
    for r, got in enumerate(load(table, world, f"{kind}-loader")):
        straight, resumed = got["straight"], got["resumed"]
        assert resumed["tied"] and resumed["steps"] == straight["steps"] == 8
        assert len(straight["losses"]) == 8
        warned = [m for m in got["said"] if "not bit for bit" in m]
        if (kind, world) == ("ddp", 3):
            close(resumed["state"], straight["state"])
            assert len(warned) == 1 and "engine='ddp' on 3 ranks: the resumed run ends within rounding" in warned[0]
            assert "lt.DDP(find_unused_parameters=True)" in warned[0]
            continue
        same_bits(resumed["state"], straight["state"])
        assert resumed["losses"][-3:] == straight["losses"][-3:]
        assert warned == [], warned


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


@pytest.mark.parametrize("world", WORLDS)
def test_fsdp2_refuses_gradual_unfreezing_by_name(table, world):
    for r in load(table, world, "unfreeze_refused"):
        assert "requires_grad was turned on during a sharded run" in r["message"], r["message"]


@pytest.mark.parametrize("world", WORLDS)
def test_what_fully_shard_cannot_take_is_refused_before_anything_changes(table, world):
    for r in load(table, world, "fsdp2_refusals"):
        (scalar, kept), (offload, kept_too) = r.items()
        assert kept and kept_too
        assert "engine='fsdp2': slot 0 ('gain') is a 0-dim parameter" in scalar and "shape (1,)" in scalar, scalar
        assert "FSDP2(cpu_offload=True) is not built yet" in offload, offload


@pytest.mark.parametrize("world", WORLDS)
def test_fsdp2s_options_keep_the_values(table, world):
    """``reshard_after_forward=False`` gathers once per item: the default's bits; bfloat16
    gathers (``param_dtype``) train float32 values that stay near the float32 run's, with
    a first loss near the float32 one and not it."""
    same_bits(load(table, world, "fsdp2-no_reshard")[0]["state"], load(table, world, "fsdp2-gpt")[0]["state"])
    ranks = load(table, world, "fsdp2-bfloat16")
    ref = cases.ended(*cases.run("gpt", 1))
    for got in ranks:
        same_bits(got["state"], ranks[0]["state"])
        assert got["tied"] and all(v.dtype == ref["state"][k].dtype for k, v in got["state"].items())
    torch.testing.assert_close(ranks[0]["state"], ref["state"], rtol=0.05, atol=0.02)
    assert any(not torch.equal(ranks[0]["state"][k], ref["state"][k]) for k in ref["state"])
    assert ranks[0]["losses"][0][1] == pytest.approx(ref["losses"][0][1], rel=2e-2)  # computed in bfloat16:
    assert ranks[0]["losses"][0][1] != pytest.approx(ref["losses"][0][1], rel=1e-6)


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_frozen_slots_stay_as_they_were(table, engine):
    start = cases.CASES["frozen_backbone"][0]().state_dict()
    for world in WORLDS:
        got = load(table, world, f"{engine}-frozen_backbone")[0]["state"]
        frozen = [k for k in got if k.startswith("backbone.") and "running" not in k and "num_batches" not in k]
        assert frozen and all(torch.equal(got[k], start[k]) for k in frozen)


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
@pytest.mark.parametrize("world", WORLDS)
def test_the_same_run_twice_gives_the_same_bits(table, world, engine):
    same_bits(load(table, world, f"{engine}-repeat")[0]["state"], load(table, world, f"{engine}-gpt")[0]["state"])


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
@pytest.mark.parametrize("world", WORLDS)
def test_evaluations_are_the_jobs(table, world, engine):
    ref = cases.ended(*cases.run("cnn_batchnorm", 1, eval_data=cases.CASES["cnn_batchnorm"][1][:5], eval_every=2))
    ranks = load(table, world, f"{engine}-eval")
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
    for got in load(table, 3, "fsdp2-resumed"):  # the DDP file continued by engine="fsdp2"
        close(got["state"], ref["state"])
        assert got["tied"]
    for got in load(table, 3, "fsdp2-resumed_folder"):  # fsdp2's folder of 2 ranks, read in FSDP2's 3 ranges
        close(got["state"], ref["state"])
        assert got["tied"]


def test_an_fsdp2_folder_resumes_under_parameter_sharding_then_in_one_process(table):
    """fsdp2 on 2 ranks (2 updates, its folder) -> sharding="parameters" on 3 ranks (the 3rd)
    -> one process (the 4th): where the straight one-process run ends."""
    assert (table / "after2_fsdp2").is_dir() and (table / "after3_parameters").is_dir()
    ref = cases.ended(*cases.run("gpt", 1))
    got = cases.ended(*cases.run("gpt", 1, resume_from=str(table / "after3_parameters")))
    assert got["tied"]
    close(got["state"], ref["state"])


@pytest.mark.parametrize("engine, where", [("ddp", "DDP's gradient all-reduce"), ("fsdp2", "FSDP2's all-gather")])
def test_a_peer_lost_in_a_torch_engines_collective_is_a_collective_error_naming_rank_update_and_checkpoint(
        tmp_path, engine, where):
    child = Path(__file__).parent / "ddp_lost_peer_child.py"
    code, out, err = spawning.rank_0_of_two(child, str(tmp_path / "init"), str(tmp_path), engine)
    assert code == 3, err[-2000:]
    assert out.startswith("CollectiveError | train_samples: rank 0 of 2, update 4: a collective operation failed "
                          f"({where}"), out
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


SAYS = {"ddp": "torch's all-reduce", "fsdp2": "torch's fully_shard"}


@pytest.fixture(scope="module")
def one_process_command(tmp_path_factory):
    """The one-process command's run, which both engines' runs are compared with."""
    out = tmp_path_factory.mktemp("command") / "one"
    command(out, 1)
    return out


@pytest.mark.skipif(TORCHRUN is None, reason="no torchrun")
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_the_command_with_a_torch_engine_under_torchrun(tmp_path, engine, one_process_command):
    """``--engine ddp`` / ``fsdp2`` on the digits preset, 2 processes: the one-process run's
    values (rtol 1e-5), a checkpoint (fsdp2's a folder) the plain command resumes, ``export
    --dcp`` of it."""
    console = command(tmp_path / engine, 2, "--engine", engine)
    assert f"2 processes, engine {engine} ({SAYS[engine]}: not the bits of one process)" in console
    assert json.loads((tmp_path / engine / "config.json").read_text())["engine"] == engine  # what a resume reads
    assert (tmp_path / engine / "checkpoint.ckpt").is_dir() == (engine == "fsdp2")
    one, got = storages(one_process_command / "checkpoint.ckpt"), storages(tmp_path / engine / "checkpoint.ckpt")
    assert sorted(one) == sorted(got)
    for k in one:
        torch.testing.assert_close(got[k], one[k], rtol=RTOL, atol=ATOL)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    resumed = subprocess.run([sys.executable, "-m", "leantrain", "train", "--resume", str(tmp_path / engine),
                              "--max-steps", "8"], capture_output=True, text=True, timeout=300, env=env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert lt.read_checkpoint(tmp_path / engine / "checkpoint.ckpt")[0]["progress"]["step"] == 8
    exported = subprocess.run([sys.executable, "-m", "leantrain", "export", str(tmp_path / engine), "--dcp", "-o",
                               str(tmp_path / "dcp")], capture_output=True, text=True, timeout=300, env=env)
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert (tmp_path / "dcp" / ".metadata").is_file()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a torch engine over NCCL needs two CUDA devices")
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_a_torch_engine_over_nccl_ends_where_one_device_ends(tmp_path, engine):
    spawning.spawn(cases.cuda_worker, (2, str(tmp_path / "init"), str(tmp_path), engine), 2)
    ref = cases.ended(*cases.cuda_run("gpt", torch.device("cuda", 0)))
    for r in range(2):
        got = torch.load(tmp_path / f"cuda.{r}.pt", weights_only=False)
        assert got["tied"]
        close({k: v.cpu() for k, v in got["state"].items()}, {k: v.cpu() for k, v in ref["state"].items()})
