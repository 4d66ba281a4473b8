"""Ranks given different data all refuse to start, with the same reason (none trains alone)."""

import json
import socket

import pytest
import torch
import torch.multiprocessing as mp

import spawning
import leantrain as lt
import rank_cases

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")


def test_ranks_with_different_numbers_of_items_all_refuse(tmp_path):
    spawning.spawn(rank_cases.worker, (2, str(tmp_path / "init"), str(tmp_path)), 2)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0] == results[1]
    host = socket.gethostname()
    assert f"the ranks run different loops (rank 0 on {host}: n_samples=6; rank 1 on {host}: n_samples=8)" in results[0]
    assert "give every rank the same data and settings" in results[0]


def test_a_relaunch_whose_ranks_see_different_checkpoints_names_the_nodes_and_the_cause(tmp_path):
    """#40: rank 0 finds a checkpoint to resume where rank 1 finds none (a folder per node,
    rank 0 moved): every rank refuses alike, naming each rank's node and the folder as
    the cause, before anything trains."""
    r, samples, cfg = rank_cases.resume_job()
    lt.train_samples(r, lt.TrainConfig(**dict(cfg, steps=2, checkpoint_path=str(tmp_path / "ck0.ckpt"))), samples,
                     log=None)
    spawning.spawn(rank_cases.resume_worker, (2, str(tmp_path / "init"), str(tmp_path)), 2)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0] == results[1]
    host = socket.gethostname()
    assert f"rank 0 on {host}: resume=True; rank 1 on {host}: resume=False" in results[0], results[0]
    assert "some ranks found a checkpoint to resume and others did not" in results[0]
    assert "rank 0 on the node that holds the checkpoints" in results[0]


@pytest.mark.slow
def test_dropout_draws_follow_the_item_not_the_rank(tmp_path):
    """Each item starts from the generator state it has in one process, whichever rank
    computes it, with the default settings on both sides (five items on two ranks: uneven
    shares): with exact_reduction, two ranks give the one-process bits with dropout (and
    BatchNorm); the default all-reduce agrees to rounding; the ranks' generators end where
    one process's does. (Seeded items, ``item_seeds=True``: ``test_item_seeds.py``.)"""
    torch.set_num_threads(1)
    spawning.spawn(rank_cases.dropout_worker, (2, str(tmp_path / "init"), str(tmp_path)), 2)
    for bn in (False, True):
        for exact in (False, True):
            state, losses, rng = rank_cases.dropout_run(bn, exact)
            for rank in range(2):
                got = torch.load(tmp_path / f"d{int(bn)}{int(exact)}.{rank}.pt")
                assert torch.equal(got["rng"], rng), (bn, exact, rank)
                for k, v in state.items():
                    if exact:
                        assert torch.equal(got["state"][k], v), (bn, k)
                    else:
                        torch.testing.assert_close(got["state"][k], v, rtol=1e-5, atol=1e-6)
            if exact:
                assert torch.load(tmp_path / f"d{int(bn)}1.0.pt")["losses"] == losses


@pytest.mark.slow
def test_a_two_rank_dropout_run_resumed_in_fresh_processes_is_the_one_process_run(tmp_path):
    torch.set_num_threads(1)
    for phase in ("stop", "resume"):  # each a fresh pair of processes
        mp.spawn(rank_cases.dropout_resume_worker, args=(2, str(tmp_path / f"init-{phase}"), str(tmp_path), phase),
                 nprocs=2, join=True)
    state, losses = rank_cases.dropout_resume_run(tmp_path, "full")
    got = torch.load(tmp_path / "resume.pt")
    assert got["losses"] == losses
    for k, v in state.items():
        assert torch.equal(got["state"][k], v), k
