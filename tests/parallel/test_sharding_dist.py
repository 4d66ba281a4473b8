"""Sharding (ZeRO stages 1 and 2) on 1, 2 and 3 gloo processes: with exact_reduction
the one-process bits (weights, buffers, whole optimizer state, logged losses) for every
optimizer family; the default reduction to rounding; 1/W of the state per rank; a run
saved on 2 ranks resumes on 1 and on 3 to the uninterrupted run's bits."""

import pytest
import torch

import spawning
import shard_cases as sc

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")


def spawn(tmp, world, plan):
    spawning.spawn(sc.worker, (world, str(tmp / f"init-{world}"), str(tmp), plan), world)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shards")
    torch.set_num_threads(1)
    spawn(tmp, 2, [(c, "w2", False, False) for c in sc.CASES] + [(c, "x", True, False) for c in sc.RESUME_CASES])
    for case in sc.CASES:
        sc.run(case, tmp, "w1")
        sc.run(case, tmp, "plain", sharding=None)
    for case in sc.RESUME_CASES:
        sc.run(case, tmp, "r1", resume=True)
    spawn(tmp, 3, [(c, "w3", False, False) for c in sc.CASES] + [(c, "r3", False, True) for c in sc.RESUME_CASES])
    return tmp


def reference(case):
    """Clipping by norm under gradient sharding takes the block norm (not clip_grad_norm_'s
    bits): its reference is the sharded run on one process, which matches on any world size."""
    return "w1" if case.startswith("lm-") and case.endswith("-gradients") else "plain"  # "-slot": clip_grad_norm_'s


bits, same_bits = sc.bits, sc.same_bits


EXACT = [c for c in sc.CASES if "-exact-" in c]
DEFAULT = [c for c in sc.CASES if "-default-" in c]


@pytest.mark.slow
@pytest.mark.parametrize("case", EXACT)
@pytest.mark.parametrize("world", [2, 3])
def test_exact_sharded_runs_give_the_one_process_bits(runs, case, world):
    same_bits(runs / f"{case}.{reference(case)}", runs / f"{case}.w{world}")


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in EXACT if reference(c) == "plain"])
def test_one_sharded_process_is_the_unsharded_process(runs, case):
    same_bits(runs / f"{case}.plain", runs / f"{case}.w1")


@pytest.mark.slow
@pytest.mark.parametrize("case", DEFAULT)
@pytest.mark.parametrize("world", [2, 3])
def test_default_reduction_agrees_to_rounding(runs, case, world):
    ta, la, _ = sc.contents(runs / f"{case}.{reference(case)}")
    tb, lb, _ = sc.contents(runs / f"{case}.w{world}")
    assert sorted(ta) == sorted(tb)
    for k in ta:
        torch.testing.assert_close(tb[k], ta[k], rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")
    torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.slow
@pytest.mark.parametrize("name", sc.ZOO)
@pytest.mark.parametrize("world", [2, 3])
def test_the_zoo_sharded_on_many_ranks_equals_plain_pytorch(runs, name, world):
    """Plain PyTorch on a deep copy (``shard_cases.against_plain_pytorch``)."""
    sc.against_plain_pytorch(name, runs / f"zoo.{name}-adamw-exact-gradients.w{world}")


@pytest.mark.parametrize("case", [c for c in sc.CASES if c.startswith("wide-") and "-default-" in c
                                  and not c.endswith("-slot")])
@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_holds_its_share_of_the_state(runs, case, world):
    whole = int((runs / f"{case}.plain.elements0").read_text())
    per_rank = [int((runs / f"{case}.w{world}.elements{r}").read_text()) for r in range(world)]
    assert sum(per_rank) == whole  # every element's state held once
    kinds = 2 if whole and any(k in case for k in ("-adam", "-adadelta")) else 1
    assert max(per_rank) <= whole / world + 64 * kinds * 5  # 1/W plus at most a block per slot and kind
    if whole:
        assert min(per_rank) > 0


@pytest.mark.slow
@pytest.mark.parametrize("case", sc.RESUME_CASES)
@pytest.mark.parametrize("tag", ["r1", "r3"])
def test_a_run_saved_on_two_ranks_resumes_on_one_and_three(runs, case, tag):
    same_bits(runs / f"{case}.{reference(case)}", runs / f"{case}.{tag}")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["chunks", "direct"])
def test_bounded_transfers_give_the_same_bits(runs, world, kind):
    """``chunks``: one bucket in flight and all-gathers of 128 elements; ``direct``: the
    reduce-scatter's larger ranges sent alone beside the smaller ones concatenated. Both:
    the default run's bits."""
    same_bits(runs / f"wide-adamw-default-gradients.w{world}", runs / f"wide-adamw-default-gradients-{kind}.w{world}")
