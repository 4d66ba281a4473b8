"""A sharded run whose checkpoint folder is not one every rank shares (a disk of its own
per node) is refused on every rank before anything trains, naming the ranks that do not
see rank 0's files; a shared folder trains as before, and so does an unsharded run with
a folder per node (rank 0 alone writes its checkpoints, as the distributed guide says) (#40)."""

import socket

import pytest
import torch

import spawning
import folder_cases

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")


@pytest.mark.parametrize("sharding", ["optimizer", None])
@pytest.mark.parametrize("per_node", [True, False])
def test_a_checkpoint_folder_per_node_is_refused_on_every_rank_before_training(tmp_path, per_node, sharding):
    spawning.spawn(folder_cases.worker, (2, str(tmp_path / "init"), str(tmp_path), per_node, sharding), 2)
    results = [(tmp_path / f"result{r}.txt").read_text() for r in (0, 1)]
    if not per_node or sharding is None:
        assert results == ["trained", "trained"]
        assert not list((tmp_path / "shared").glob(".leantrain-probe-*"))  # the probe is gone
        return
    for r, text in enumerate(results):  # the same refusal on each rank, naming its own path
        assert text.startswith(f"ConfigError unchanged=True train_samples: checkpoint_path {tmp_path / f'node{r}'}"), text
        host = socket.gethostname()
        assert f"rank(s) [1] of 2 (on {host}) do not see the files rank 0 (on {host}) writes in" in text
    assert not (tmp_path / "node1" / "ck").exists() and not (tmp_path / "node0" / "ck").exists()
