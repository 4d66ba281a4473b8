"""Dropout under data parallel without replaying every item (#55, item 4).

With several processes each item's forward draws from generators seeded for it (one draw
of the run's generator per update and the item's index, ``runner/item_seeds.py``), so a
rank runs the forwards of its own items only: on 4 ranks with 8 items per update, 2
forwards per rank per update where the replay ran 10 (the first update adds one forward,
which learns whether the model draws at all). The bits are the same on 1 (``item_seeds=True``),
2 and 4 ranks, unsharded with ``exact_reduction``, under ``"gradients"`` and under
``"parameters"``, for the GPT (dropout) and the BatchNorm CNN (whose buffer pass then draws
each item's seeded numbers too). ``item_seeds=False`` keeps the replay: one process's plain
bits on any number of ranks."""

import pytest
import torch

import item_seed_cases as cases
import leantrain as lt
import spawning

pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed"),
              pytest.mark.slow]


def kept(path) -> tuple[dict, list]:
    manifest, tensors = lt.read_checkpoint(path)
    return {k: t for k, t in tensors.items() if k.startswith(("storage.", "state."))}, manifest["progress"]["losses"]


def forwards(tmp_path, name: str, world: int) -> list[int]:
    return [int((tmp_path / f"{name}.forwards{r}").read_text()) for r in range(world)]


def test_item_seeds_give_one_bits_on_any_world_and_each_rank_runs_its_own_items(tmp_path):
    torch.set_num_threads(1)
    for model in cases.MODELS:
        cases.run(tmp_path, model, "one", item_seeds=True)
    cases.run(tmp_path, "gpt", "plain")  # one process's default: the plain loop's draws
    for world in (2, 4):
        spawning.spawn(cases.worker, (world, str(tmp_path / f"init{world}"), str(tmp_path)), world)
    for model in cases.MODELS:
        one, losses = kept(tmp_path / f"{model}-one")
        for world in (2, 4):
            for mode in cases.MODES:
                got, got_losses = kept(tmp_path / f"{model}-{mode}-{world}")
                assert [k for k in one if not torch.equal(one[k], got[k])] == [], (model, mode, world)
                assert got_losses == losses
    own = cases.BATCH // 4 * cases.STEPS
    assert forwards(tmp_path, "gpt-None-4", 4) == [own + 1] * 4  # its items, and one forward that learns
    assert forwards(tmp_path, "gpt-parameters-4", 4) == [own + 1] * 4
    assert forwards(tmp_path, "gpt-replay-4", 4) == [own + cases.BATCH * cases.STEPS] * 4  # every item again
    plain, _ = kept(tmp_path / "gpt-plain")
    seeded, _ = kept(tmp_path / "gpt-one")
    assert any(not torch.equal(plain[k], seeded[k]) for k in plain)  # the seeds draw other numbers
    for world in (2, 4):
        replayed, _ = kept(tmp_path / f"gpt-replay-{world}")
        assert [k for k in plain if not torch.equal(plain[k], replayed[k])] == []
