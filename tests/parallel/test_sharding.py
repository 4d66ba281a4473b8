"""Sharding in one process: the shard plan's rules, the kernels' 64-element position rule
it relies on (a guard: a torch upgrade that changes it fails here), and the refusals."""

from dataclasses import replace

import pytest
import torch
from torch import nn

import leantrain as lt
from leantrain.optim.rules import rule_for
from leantrain.training.parallel.sharding.plan import ALIGN, plan_shards
from optimizer_table import SHARDABLE, TABLE
import shard_cases as sc


def test_a_plan_of_whole_slots_gives_each_slot_to_one_rank(world=3):
    sizes = [180, 1296, 36, 1296, 36, 108, 3, 0]
    plan = plan_shards("gradients", sizes, [0, 1, 2, 1, 4, 5, None, 7], world, by="slot")
    assert [(r.slot, r.start, r.stop) for r in plan.ranges] == [(i, 0, sizes[i]) for i in (0, 1, 2, 4, 5, 7)]
    assert plan.range_of(1, 0) == plan.ranges[1] and plan.ranges[1].rank == 0  # the largest first, to rank 0
    assert {r.rank for r in plan.ranges} == {0, 1, 2}
    with pytest.raises(lt.ConfigError, match="shard_by must be one of"):
        plan_shards("gradients", sizes, [0, 1, 2, 1, 4, 5, None, 7], world, by="block")


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_a_plan_tiles_every_trainable_slot_once(world):
    sizes = [180, 1296, 36, 1296, 36, 108, 3, 0]
    slots_map = [0, 1, 2, 1, 4, 5, None, 7]  # slot 3 an alias of 1, slot 6 frozen
    plan = plan_shards("optimizer", sizes, slots_map, world)
    assert plan == plan_shards("optimizer", sizes, slots_map, world)  # a pure function
    for i, c in enumerate(slots_map):
        ranges = [r for r in plan.ranges if r.slot == i]
        if c != i:
            assert ranges == []  # aliases and frozen slots are not cut of their own
            continue
        covered = sorted((r.start, r.stop) for r in ranges)
        assert covered[0][0] == 0 and covered[-1][1] == sizes[i]
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # no gap, no overlap
        assert all(r.start % ALIGN == 0 for r in ranges)
        assert len({r.rank for r in ranges}) == len(ranges) <= world  # at most one range per rank
    assert plan.range_of(3, 0) == plan.range_of(1, 0)  # an alias shares its representative's cut
    assert plan.range_of(6, 0) is None
    if world > 1:  # small slots spread over the ranks
        assert len({r.rank for r in plan.ranges if sizes[r.slot] <= ALIGN}) > 1


@pytest.mark.parametrize("name", SHARDABLE)
def test_kernels_give_an_element_the_same_bits_at_any_64_aligned_cut(name):
    """The rule sharding relies on: updating a tensor in pieces cut at multiples of 64
    elements gives every element the bits the whole tensor's update gives it."""
    opt = TABLE[name].make()
    rule = rule_for(opt.hyper)
    g = torch.Generator().manual_seed(3)
    p = torch.randn(1000, generator=g)
    grads = [torch.randn(1000, generator=g) for _ in range(3)]
    whole, rec = p.clone(), rule.init(opt.hyper, p)
    cuts = [(0, 128), (128, 576), (576, 1000)]
    pieces = [p.clone()[a:b].clone() for a, b in cuts]
    recs = [rule.init(opt.hyper, x) for x in pieces]
    with torch.no_grad():
        for gr in grads:
            rec = rule.update_many(opt.hyper, opt.lr, [rec], [whole], [gr.clone()], uniform=True)[0]
            recs = rule.update_many(opt.hyper, opt.lr, recs, pieces, [gr[a:b].clone() for a, b in cuts], uniform=True)
    assert torch.equal(torch.cat(pieces).view(torch.int32), whole.view(torch.int32))
    for k, t in rec.tensors().items():
        assert torch.equal(torch.cat([r.tensors()[k] for r in recs]).view(torch.int32), t.view(torch.int32)), k


def test_sharding_settings_are_checked():
    with pytest.raises(lt.ConfigError, match="sharding must be one of"):
        lt.TrainConfig(steps=1, sharding="params")
    with pytest.raises(lt.ConfigError, match="sharding must be one of"):
        lt.LoaderTrainConfig(epochs=1, sharding=True)


def _bytes(runner):
    return [v.storage.host.clone() for v in runner.params]


def test_a_non_contiguous_parameter_is_refused_before_anything_changes():
    model = nn.Linear(4, 6)
    model.weight = nn.Parameter(torch.randn(4, 6).t())  # a transposed (strided) weight
    runner = lt.Runner.from_module(model, "mse")
    before = _bytes(runner)
    cfg = lt.TrainConfig(steps=2, batch_size=1, sharding="optimizer")
    with pytest.raises(lt.ConfigError, match=r"slot 0 \(weight\).*not contiguous"):
        lt.train_samples(runner, cfg, [(torch.randn(4), torch.randn(6))], log=None)
    assert all(torch.equal(a, b) for a, b in zip(before, _bytes(runner)))


def test_a_sparse_embedding_is_refused_before_anything_changes():
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(8, 2))
    runner = lt.Runner.from_module(model, "mse")
    before = _bytes(runner)
    cfg = lt.TrainConfig(steps=2, batch_size=1, sharding="gradients")
    with pytest.raises(lt.ConfigError, match=r"module '0' \(Embedding\) makes sparse gradients"):
        lt.train_samples(runner, cfg, [(torch.tensor([1, 2]), torch.randn(2))], log=None)
    assert all(torch.equal(a, b) for a, b in zip(before, _bytes(runner)))


def test_unfreezing_during_a_sharded_run_is_refused_with_the_remedy():
    torch.manual_seed(0)
    model = sc.Wide()
    model.head.bias.requires_grad_(False)
    runner = lt.Runner.from_module(model, "mse")
    cfg = lt.TrainConfig(steps=4, batch_size=2, sharding="gradients", optimizer=TABLE["adam"].make())

    def unfreeze(event):
        if event.step == 2:
            model.head.bias.requires_grad_(True)

    # refused before the next update, naming the slot; the remedy is a new run (a resume would re-freeze it)
    with pytest.raises(lt.ConfigError, match=r"slot 8 \('head.bias'\): requires_grad was turned on during a sharded "
                                             r"run.*Start a new sharded run with the slot trainable"):
        lt.train_samples(runner, cfg, sc.wide_data(), log=None, callback=unfreeze)


def test_block_norm_clipping_is_stated_and_bounded():
    """Gradient sharding clips by the 64-block norm: not clip_grad_norm_'s bits, but the
    same norm to rounding, and the logged norms agree with the unsharded run's."""
    reports = {}
    for sharding in (None, "gradients", "optimizer"):
        torch.manual_seed(1)
        runner = lt.Runner.from_module(sc.Wide(), "mse")
        cfg = lt.TrainConfig(steps=4, batch_size=3, clip_grad_norm=0.1, log_every=1, sharding=sharding,
                             optimizer=TABLE["sgd"].make())
        reports[sharding] = lt.train_samples(runner, cfg, sc.wide_data(), log=None)
    torch.manual_seed(1)
    runner = lt.Runner.from_module(sc.Wide(), "mse")
    cfg = lt.TrainConfig(steps=4, batch_size=3, clip_grad_norm=0.1, log_every=1, sharding="gradients",
                         shard_by="slot", optimizer=TABLE["sgd"].make())
    reports["slot"] = lt.train_samples(runner, cfg, sc.wide_data(), log=None)
    plain, blocks, whole = (reports[k].grad_norms for k in (None, "gradients", "optimizer"))
    assert whole == plain  # optimizer sharding keeps whole gradients: clip_grad_norm_'s bits
    assert reports["slot"].grad_norms == plain  # whole slots per rank: clip_grad_norm_'s bits too
    assert [s for s, _ in blocks] == [s for s, _ in plain]
    for (_, a), (_, b) in zip(blocks, plain):
        assert a == pytest.approx(b, rel=1e-6) and a > 0.1  # clipping was active


def test_a_sharded_checkpoint_is_a_whole_checkpoint(tmp_path):
    """The folder a sharded run writes holds the whole state: an unsharded run resumes it."""
    torch.manual_seed(1)
    runner = lt.Runner.from_module(sc.Wide(), "mse")
    cfg = lt.TrainConfig(steps=3, batch_size=3, sharding="gradients", optimizer=TABLE["adam"].make(),
                         checkpoint_path=tmp_path / "a.ckpt")
    lt.train_samples(runner, cfg, sc.wide_data(), log=None)
    torch.manual_seed(1)
    again = lt.Runner.from_module(sc.Wide(), "mse")
    lt.train_samples(again, replace(cfg, steps=5, sharding=None, resume_from=tmp_path / "a.ckpt",
                                    checkpoint_path=tmp_path / "b.ckpt"), sc.wide_data(), log=None)
    torch.manual_seed(1)
    straight = lt.Runner.from_module(sc.Wide(), "mse")
    lt.train_samples(straight, replace(cfg, steps=5, sharding=None, checkpoint_path=None), sc.wide_data(), log=None)
    for a, b in zip(again.module.state_dict().values(), straight.module.state_dict().values()):
        assert torch.equal(a, b)


class Unused(sc.Wide):
    def __init__(self):
        super().__init__()
        self.spare = nn.Linear(36, 36)  # never called: no gradient, so no update (torch's rule)


@pytest.mark.parametrize("sharding", ["optimizer", "gradients"])
def test_one_sharded_process_leaves_an_unused_slot_alone(sharding):
    out = {}
    for sh in (None, sharding):
        torch.manual_seed(1)
        runner = lt.Runner.from_module(Unused(), "mse")
        start = runner.module.spare.weight.detach().clone()
        cfg = lt.TrainConfig(steps=3, batch_size=3, sharding=sh, optimizer=TABLE["adamw"].make())
        lt.train_samples(runner, cfg, sc.wide_data(), log=None)
        assert torch.equal(runner.module.spare.weight, start)
        out[sh] = [t.clone() for t in runner.module.state_dict().values()]
    assert all(torch.equal(a, b) for a, b in zip(out[None], out[sharding]))


def test_a_sharded_moving_average_holds_its_ranges_with_the_whole_average_bits():
    """Rank 0's share of a 2-rank plan, updated in one process: only its ranges are kept,
    each with the bits the whole average has there (the lerp, cut at multiples of 64)."""
    from leantrain.training.runner.ema import EMA
    from leantrain.training.parallel.sharding.ema import ShardedEMA
    from leantrain.training.parallel.sharding.plan import plan_for

    torch.manual_seed(1)
    runner = lt.Runner.from_module(sc.Wide(), "mse")
    plan = plan_for("gradients", runner.params, 2)
    whole, part = EMA(runner.params, 0.9), ShardedEMA(runner.params, 0.9, plan, 0)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        with torch.no_grad():
            for v in runner.params.storages():
                if v.host.is_floating_point():
                    v.host.add_(torch.randn(v.host.shape, generator=g))
        whole.update(runner.params), part.update(runner.params)
    held = sum(t.numel() for t in part.values if t is not None)
    assert held == plan.elements(0) < sum(v.storage.host.numel() for v in runner.params) / 2 + 64 * 8
    for k, r in part.ranges.items():
        assert torch.equal(part.values[k], whole.values[k].reshape(-1)[r.start: r.stop])


def test_a_sharded_resume_moves_only_its_ranges_to_the_device(tmp_path):
    """A resumed state is read into host memory (``host_state``) and cut there: the
    device (here ``meta``, standing in for an accelerator's memory) receives rank 0's
    ranges of a 2-rank plan and no whole tensor (the sharded resume tests check the
    values). Without ``host_state`` the whole state lands on the device."""
    from leantrain.training.parallel.sharding.plan import plan_for
    from leantrain.training.parallel.sharding.state import sharded

    torch.manual_seed(1)
    runner = lt.Runner.from_module(sc.Wide(), "mse")
    runner.params.to_device("cpu")
    cfg = lt.TrainConfig(steps=2, batch_size=3, optimizer=TABLE["adam"].make(), checkpoint_path=tmp_path / "a.ckpt")
    lt.train_samples(runner, cfg, sc.wide_data(), log=None)
    for v in runner.params.storages():
        v.mirror = torch.empty_like(v.host, device="meta")  # where each slot's working tensor now lives
    devices = {}
    for host_state in (False, True):
        ck = lt.load_checkpoint(tmp_path / "a.ckpt", runner, optimizer=cfg.optimizer, host_state=host_state)
        devices[host_state] = {t.device.type for rec in ck.state.records().values() for t in rec.tensors().values()}
    assert devices == {False: {"meta"}, True: {"cpu"}}
    plan = plan_for("gradients", runner.params, 2)
    cut = sharded(ck.state, plan, 0, runner.params)
    for r in plan.owned(0):
        for k, t in cut.slots[r.slot].tensors().items():
            assert t.device.type == "meta" and t.numel() == r.size
    assert all(cut.slots[i] is None for i in range(len(runner.params)) if i not in {r.slot for r in plan.owned(0)})


@pytest.mark.parametrize("sharding, by", [("optimizer", "range"), ("gradients", "range"), ("gradients", "slot")])
def test_a_sharded_run_on_device_mirrors_equals_the_unsharded_one(sharding, by):
    """The native path on CPU mirrors (the CUDA semantics, tested here): ranges of the
    mirrors updated by the fused kernels, the moving average, clipping."""
    out = []
    for sh in (None, sharding):
        torch.manual_seed(4)
        r = lt.Runner.from_module(sc.Wide(), "mse").to("cpu")
        cfg = lt.TrainConfig(steps=5, batch_size=3, optimizer=TABLE["adamw"].make(), log_every=1, ema_decay=0.9,
                             clip_grad_norm=0.5 if by == "slot" or sharding == "optimizer" else None,
                             sharding=sh, shard_by=by)
        report = lt.train_samples(r, cfg, sc.wide_data(), log=None)
        assert all(s.mirror is not None for s in r.params.storages())
        out.append(([t.clone() for t in r.params.values_synced()], report.losses, r.ema_values()))
    (a, la, ea), (b, lb, eb) = out
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and la == lb
    assert all(torch.equal(x, y) for x, y in zip(ea, eb))


@pytest.mark.parametrize("name", [n for n in TABLE if n not in SHARDABLE])
@pytest.mark.parametrize("sharding", ["optimizer", "gradients"])
def test_a_rule_that_needs_whole_matrices_is_refused_under_sharding_before_anything_runs(name, sharding):
    torch.manual_seed(0)
    runner = lt.Runner.from_module(sc.Wide(), "mse")
    before = _bytes(runner)
    cfg = lt.TrainConfig(steps=2, batch_size=2, sharding=sharding, optimizer=TABLE[name].make())
    with pytest.raises(lt.ConfigError, match="whole matrix"):
        lt.train_samples(runner, cfg, sc.wide_data(), log=None)
    assert all(torch.equal(a, b) for a, b in zip(before, _bytes(runner)))
