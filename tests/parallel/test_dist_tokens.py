"""``LossSum`` under torch.distributed (gloo, 2 and 3 processes): the counts are reduced
with the totals, so an update is (sum of totals) / (sum of counts) over every rank's
items. ``exact_reduction`` gives the one-process bits on any world size (a rank without
items included); the default reduction agrees to rounding. ``pieces`` cuts a collated
batch along dimension 0 so every rank computes a share of it."""

import pytest
import torch
from safetensors.torch import load_file

import spawning
import leantrain as lt
import token_cases as tc

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tokens")
    torch.set_num_threads(1)
    for world in (2, 3):
        spawning.spawn(tc.worker, (world, str(tmp / f"init-{world}"), str(tmp)), world)
    for case in tc.CASES:
        tc.run(case, tmp, "w1")
    tc.run("loader-4-exact", tmp, "uncut", pieces=None)
    return tmp


def bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.slow
@pytest.mark.parametrize("case", tc.CASES)
@pytest.mark.parametrize("world", [2, 3])
def test_token_sums_on_many_ranks(runs, case, world):
    one = load_file(str(runs / f"{case}.w1.safetensors"))
    many = load_file(str(runs / f"{case}.w{world}.safetensors"))
    assert sorted(one) == sorted(many) and len(one["losses"]) >= 2
    one.pop("buffer_passes"), many.pop("buffer_passes")  # how many passes ran differs (see below)
    moved = max(float((one[k] - tc_start(k)).abs().max()) for k in one if k.startswith("w.emb"))
    assert moved > 1e-3  # it trained
    for k in one:
        if case.endswith("-exact"):
            assert torch.equal(bits(one[k]), bits(many[k])), k
        else:
            torch.testing.assert_close(many[k], one[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("world", [2, 3])
def test_idle_ranks_are_named_once(runs, world):
    said = (runs / f"loader-0-default.w{world}.warned").read_text().splitlines()
    assert said == [f"train_loader: an update has 1 item(s) for {world} ranks, so some ranks compute nothing (a "
                    f"collated batch is one item): pass pieces=N to cut each loader batch along dimension 0 into "
                    f"N items"]
    assert (runs / f"loader-4-default.w{world}.warned").read_text() == ""


def tc_start(key):
    torch.manual_seed(0)
    return tc.TinyLM().state_dict()[key[2:]]


@pytest.mark.parametrize("world", [2, 3])
def test_a_mask_buffer_costs_one_buffer_pass_under_data_parallel(runs, world):
    """The model's mask buffer is never written: the first data-parallel step's buffer pass
    (every rank, every item) shows it, and no later step pays that extra forward."""
    passes, steps = load_file(str(runs / f"samples-5-default.w{world}.safetensors"))["buffer_passes"].tolist()
    assert steps == 4 and passes == 1
    assert load_file(str(runs / "samples-5-default.w1.safetensors"))["buffer_passes"].tolist() == [0, 4]


def test_pieces_keep_the_token_mean(runs):
    """Cutting each collated batch into 4 pieces changes no weight beyond rounding: with a
    LossSum the pieces' (sum of totals) / (sum of counts) is the uncut batch's."""
    cut = load_file(str(runs / "loader-4-exact.w1.safetensors"))
    whole = load_file(str(runs / "loader-4-exact.uncut.safetensors"))
    for k in cut:
        torch.testing.assert_close(cut[k], whole[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_a_token_sum_update_is_the_window_token_mean():
    """One process, one update over 3 items of different token counts: the gradient is that
    of (t1 + t2 + t3) / (c1 + c2 + c3), not the mean of the items' means."""
    items = tc.dict_items(3)
    torch.manual_seed(0)
    runner = lt.Runner.from_module(tc.TinyLM(), "model")
    grads = lt.mean_gradients(runner, items)
    torch.manual_seed(0)
    ref = tc.TinyLM()
    outs = [ref(**s)["loss"] for s in items]
    total = sum(o.total for o in outs[1:]) + outs[0].total
    (total / sum(int(o.count) for o in outs)).backward()
    assert len({int(o.count) for o in outs}) > 1  # the items weigh differently
    got = {slot.name: g for slot, g in zip(runner.params, grads)}
    got["emb.weight"] = got["emb.weight"] + got.pop("head.weight")  # a tie's slots hold each use's share
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-6)
    mean_of_means = sum(o.total / o.count for o in outs) / 3
    assert abs(float(mean_of_means) - float(total / sum(int(o.count) for o in outs))) > 1e-3  # far beyond the rounding above


def test_split_rows_rules():
    s = {"input_ids": torch.arange(10).view(5, 2), "attention_mask": torch.ones(5, 2), "scale": torch.tensor(2.0),
         "tag": "keep"}
    parts = lt.split_rows(s, 2)
    assert [p["input_ids"].shape[0] for p in parts] == [3, 2]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts]), s["input_ids"])
    assert all(p["tag"] == "keep" and p["scale"] is s["scale"] for p in parts)
    assert len(lt.split_rows((torch.zeros(3, 4), torch.zeros(3)), 8)) == 3  # one piece per row at most
    with pytest.raises(lt.DataError, match=r"disagree on their rows.*\['labels'\]: 4"):
        lt.split_rows({"input_ids": torch.zeros(5, 2), "labels": torch.zeros(4, 2)}, 2)
    with pytest.raises(lt.ConfigError, match="pieces must be an integer >= 1"):
        lt.split_rows(s, 0)
    with pytest.raises(lt.ConfigError, match="pieces"):
        lt.LoaderTrainConfig(epochs=1, pieces=0)
