"""Rank-local data on 2 and 3 gloo processes: each rank reads only its own items through a
torch DistributedSampler; with exact_reduction the run equals one process folding the
same items in the global order (item j is rank j mod W's) bit for bit; a run stopped
mid-epoch resumes exactly; a sampler for another rank is refused; BatchNorm buffers stay
alike on every rank (rank 0's, broadcast after each update, as DDP)."""

import pytest
import torch
from safetensors.torch import load_file

import spawning
import rank_data_cases as rc
from rank_data_cases import same_bits

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rankdata")
    torch.set_num_threads(1)
    for world in (2, 3):
        spawning.spawn(rc.worker, (world, str(tmp / f"init-{world}"), str(tmp)), world)
        rc.reference(world, tmp / f"reference.w{world}.safetensors")
    return tmp


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_reading_its_own_items_gives_the_one_process_bits(runs, world):
    same_bits(runs / f"reference.w{world}.safetensors", runs / f"local.w{world}.safetensors")
    same_bits(runs / f"reference.w{world}.safetensors", runs / f"sharded.w{world}.safetensors")  # ZeRO-2 too


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_the_default_reduction_of_rank_local_items_agrees_to_rounding(runs, world):
    ref = load_file(str(runs / f"reference.w{world}.safetensors"))
    got = load_file(str(runs / f"sharded-default.w{world}.safetensors"))
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


@pytest.mark.slow
def test_a_rank_local_run_resumes_exactly(runs):
    same_bits(runs / "local.w2.safetensors", runs / "resumed.w2.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_a_sampler_for_another_rank_is_refused_and_buffers_stay_alike(runs, world):
    for rank in range(world):
        said = (runs / f"refused.w{world}.r{rank}").read_text()
        assert f"is for rank {(rank + 1) % world} of {world}, but this process is rank {rank} of {world}" in said
    assert (runs / f"bn.w{world}").read_text() == "True"
