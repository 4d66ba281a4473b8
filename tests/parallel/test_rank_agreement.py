"""Ranks given different data all refuse to start, with the same reason (none trains alone)."""

import json

import pytest
import torch
import torch.multiprocessing as mp

import rank_cases

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")


def test_ranks_with_different_numbers_of_items_all_refuse(tmp_path):
    mp.spawn(rank_cases.worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0] == results[1]
    assert "the ranks run different loops (rank 0: n_samples=6; rank 1: n_samples=8)" in results[0]


@pytest.mark.slow
def test_dropout_draws_follow_the_item_not_the_rank(tmp_path):
    """Each item starts from the generator state it has in one process, whichever rank
    computes it: with exact_reduction, two ranks give the one-process bits with dropout
    (and BatchNorm); the default all-reduce agrees to rounding; the ranks' generators end
    where one process's does."""
    torch.set_num_threads(1)
    mp.spawn(rank_cases.dropout_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
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
