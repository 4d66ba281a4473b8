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
