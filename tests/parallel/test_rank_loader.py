"""A leantrain DataLoader made with ``rank``/``world_size`` on 2 and 3 gloo processes: each
rank reads (and collates) only its share of every batch, the items data parallel gives
it; with exact_reduction the run equals one process over the same loader bit for bit
(ZeRO-2 too), the default reduction agrees to rounding, a run stopped on 2 ranks resumes
on 3 ranks and on one process exactly, a loader for another rank and a tail batch that
would leave a rank without items are refused, ranks handed different data by hand stop
at their first batch, and BatchNorm replicas stay alike."""

import json

import pytest
import torch
from safetensors.torch import load_file

import spawning
import leantrain as lt
import rank_loader_cases as rc
from rank_data_cases import same_bits

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rankloader")
    torch.set_num_threads(1)
    for world in (2, 3):  # 2 first: its checkpoint is resumed on 3 ranks
        spawning.spawn(rc.worker, (world, str(tmp / f"init-{world}"), str(tmp)), world)
        rc.reference_collated(world, tmp / f"reference-collated.w{world}.safetensors")
    rc.reference_items(tmp / "reference.safetensors")
    r = rc.runner()  # the 2-rank checkpoint resumed in one process, reading every item
    report, _ = lt.train_loader(r, rc.config(resume_from=tmp / "stopped.ckpt"),
                                lt.DataLoader(rc.items(), rc.BATCH, shuffle=True, seed=3), log=None)
    rc.save(r, report, tmp / "resumed.w1.safetensors")
    return tmp


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_reading_its_share_gives_the_one_process_bits(runs, world):
    same_bits(runs / "reference.safetensors", runs / f"exact.w{world}.safetensors")
    same_bits(runs / "reference.safetensors", runs / f"sharded.w{world}.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["default", "ddp"])
def test_the_default_reduction_and_torchs_ddp_agree_to_rounding(runs, world, kind):
    """``ddp``: torch's DistributedDataParallel (#69) over rank-local items, shared unevenly
    in the tail update (2/2/1 on 3 ranks)."""
    ref, got = load_file(str(runs / "reference.safetensors")), load_file(str(runs / f"{kind}.w{world}.safetensors"))
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_collates_only_its_share(runs, world):
    same_bits(runs / f"reference-collated.w{world}.safetensors", runs / f"collated.w{world}.safetensors")
    read = [int((runs / f"read.w{world}.r{r}").read_text()) for r in range(world)]
    # per epoch: 3 batches of 6 and one of 2, each rank its positions r, r + W, ...
    share = [3 * len(range(r, rc.BATCH, world)) + len(range(r, 2, world)) for r in range(world)]
    assert read == [rc.EPOCHS * k for k in share] and sum(read) == rc.EPOCHS * rc.N


@pytest.mark.slow
def test_a_run_stopped_on_two_ranks_resumes_on_three_and_on_one(runs):
    same_bits(runs / "reference.safetensors", runs / "resumed.w3.safetensors")
    same_bits(runs / "reference.safetensors", runs / "resumed.w1.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_bad_shares_are_refused_and_buffers_stay_alike(runs, world):
    for rank in range(world):
        said = json.loads((runs / f"refused.w{world}.r{rank}").read_text())
        assert f"made for rank {(rank + 1) % world} of {world}, but this process is rank {rank} of {world}" \
            in said["other rank"]
        if world == 3:
            assert "the last batch of each epoch holds 2 item(s) for 3 ranks" in said["tail alone"]
        assert "engine='fsdp2' needs every rank to read the same batches" in said["fsdp2"], said["fsdp2"]
        assert said["fsdp2 kept"] is True
        for name in ("own samples", "own batches"):  # every rank stops, before any update
            assert f"ranks {list(range(1, world))} read a first batch that differs from rank 0's" in said[name]
    assert (runs / f"bn.w{world}").read_text() == "True"
