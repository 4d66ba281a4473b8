"""Every run-management feature on 1, 2 and 3 ranks, through the Python API and the command
(#66): a stop, a best checkpoint, a prune and a lock are decided once for the job and
shared by every rank. Every rank of every world finishes, with the same weights and the
same report as its peers and as the one-process run (``exact_reduction``: the same bits on
any world size), and no rank says a false warning (a best checkpoint "gone", "another job
writes into this folder", callbacks that "start afresh").

The ranks are forked by ``spawning`` and run every case in turn (``run_table_cases.py``)."""

import json
from pathlib import Path

import pytest
import torch

import run_table_cases as cases
import spawning

pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed"), pytest.mark.slow]

PYTHON = list(cases.python_cases(Path("."), 0)) + ["resume_after_kill", "averaging"]
ALL = PYTHON + list(cases.COMMANDS)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    out = tmp_path_factory.mktemp("run_table")
    for world in cases.WORLDS:
        spawning.spawn(cases.worker, (world, str(out / f"init{world}"), str(out)), world)
    return {(name, world): [json.loads((out / str(world) / f"{name}.{r}.json").read_text()) for r in range(world)]
            for name in ALL for world in cases.WORLDS}, out


@pytest.mark.parametrize("world", cases.WORLDS)
@pytest.mark.parametrize("name", ALL)
def test_every_rank_ends_alike_without_a_false_warning(table, name, world):
    results, _ = table
    ranks = results[name, world]
    assert all(r["warnings"] == [] for r in ranks), [r["warnings"] for r in ranks]
    first = ranks[0]
    for r, other in enumerate(ranks[1:], 1):
        if name in cases.COMMANDS:  # rank 0 writes the run's files and its console; every rank exits alike
            assert other["exit"] == 0
            assert other["console"].strip() == "", other["console"]  # nothing said on other ranks
        else:
            assert other == first, f"rank {r} differs from rank 0"
    if name in cases.COMMANDS:
        assert first["exit"] == 0, first["console"]
        assert first["report"] == results[name, 1][0]["report"]  # the same run on any world (exact reduction)
    else:
        assert first == results[name, 1][0] if name != "averaging" or world == 1 else "refused" in first


def steps(results, name, world=1) -> int:
    return results[name, world][0]["report"]["steps"]


def test_the_decisions_are_the_jobs(table):
    results, out = table
    full = cases.EPOCHS * cases.STEPS_PER_EPOCH
    assert steps(results, "eval_every") == full
    assert [s for s, _ in results["eval_every", 1][0]["report"]["evals"]] == [4, 8, 12, 16, 18]  # and at the end
    evals = results["eval_per_epoch_named_sets", 1][0]["report"]["evals"]
    assert [s for s, _ in evals] == [6, 12, 18] and {"val_loss", "test_loss"} <= set(evals[0][1])
    early = steps(results, "early_stopping")
    assert early < full and early % 2 == 0  # stopped after an evaluation
    assert steps(results, "callback_stop") == 5 and results["callback_stop", 1][0]["report"]["interrupted"]
    assert steps(results, "step_callback_stop") == 7  # one rank's answer (the last rank's) stops every rank
    assert steps(results, "max_steps") == 5
    for world in cases.WORLDS:
        kept = sorted(p.name for p in (out / str(world) / "keep_last").glob("step*.ckpt"))
        assert kept == ["step15.ckpt", "step18.ckpt"]
        best = results["keep_best_load_best", world][0]["report"]["best"]
        assert best is not None and (out / str(world) / "keep_best_load_best" / best).is_file()
        csv = (out / str(world) / "trackers" / "csv").read_text().splitlines()
        lines = (out / str(world) / "trackers" / "log.jsonl").read_text().splitlines()
        assert len(csv) > 1 and len(csv) == len(set(csv)) and len(lines) == len(set(lines))  # rank 0's, once
        if world > 1:  # the same records, but for the measured rates
            def same(rows):
                return [r for r in rows if "_per_s," not in r and ",wall" not in r]
            assert same(csv) == same((out / "1" / "trackers" / "csv").read_text().splitlines())
        assert results["resume_after_kill", world][0]["report"]["resumed_from"] == "step8.ckpt"
    assert results["resume_after_kill", 1][0]["weights"] == results["eval_every", 1][0]["weights"]  # as one run
    assert results["averaging", 2][0]["refused"].startswith("train_loader: averaging runs in one process")
    assert results["averaging", 1][0]["averaged"] != results["averaging", 1][0]["weights"]
    cmd = results["cmd_keep_best", 1][0]
    assert "best checkpoint (loss)" in cmd["console"]
    early = results["cmd_early_stop_best_k", 1][0]  # the command's early stop and best K: the job's on every world
    assert "stopped early at step" in early["console"] and early["report"]["steps"] < 30
    for world in cases.WORLDS:
        kept = list((out / str(world) / "cmd_early_stop_best_k" / "checkpoints").glob("step*.ckpt"))
        assert 2 <= len(kept) <= 3  # the best two, and the newest
