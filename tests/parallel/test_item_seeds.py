"""Dropout on any number of processes (#67): one process's draws by default, at DDP's cost.

With the default settings every item draws what it draws in one process, whichever rank
computes it, and a rank runs the forwards of its own items only: it starts each one from
the update's generator state moved ahead by the earlier items' draws, counted once per
item shape by one no-gradient forward (``runner/draw_shift.py``). So the GPT (dropout)
and the BatchNorm CNN (a buffer pass and dropout) with ``exact_reduction`` give the
bits of a one-process run with the same settings, the plain loop's draws, on 2 and 4
ranks, unsharded, under ``"gradients"`` and under ``"parameters"``: no flag on any side.
``item_seeds=True`` keeps its own documented bits (seeded per item, alike on 1, 2 and 4
ranks). Items of two shapes in one update are counted per shape; a model whose draws
cannot be counted (a cached normal sample) is replayed, said once; a model whose values
decide how much it draws is refused by name."""

import json

import pytest
import torch

import item_seed_cases as cases
import leantrain as lt
import spawning

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")


def kept(path) -> tuple[dict, list]:
    manifest, tensors = lt.read_checkpoint(path)
    return {k: t for k, t in tensors.items() if k.startswith(("storage.", "state."))}, manifest["progress"]["losses"]


def forwards(tmp_path, name: str, world: int) -> list[int]:
    return [int((tmp_path / f"{name}.forwards{r}").read_text()) for r in range(world)]


def odd(tmp_path, kind: str, world: int) -> list[dict]:
    return [json.loads((tmp_path / f"odd-{kind}-{world}.{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_the_defaults_give_one_process_bits_on_any_world_and_each_rank_runs_its_own_items(tmp_path):
    torch.set_num_threads(1)
    for model in cases.MODELS:
        cases.run(tmp_path, model, "one")  # the defaults: the plain loop's draws
    for mode in (None, "parameters"):
        cases.run(tmp_path, "gpt", f"seeded-one-{mode}", sharding=mode, item_seeds=True)
    for kind in ("shapes", "small_normal", "values"):
        cases.odd_run(tmp_path, kind)
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
    assert forwards(tmp_path, "gpt-None-4", 4) == [own + 1] * 4  # its items, and one forward that counts
    assert forwards(tmp_path, "gpt-gradients-4", 4) == [own + 1] * 4
    assert forwards(tmp_path, "gpt-parameters-4", 4) == [own + 1] * 4
    assert forwards(tmp_path, "gpt-None-2", 2) == [2 * own + 1] * 2
    # item_seeds=True: its own numbers, alike on any world
    plain, _ = kept(tmp_path / "gpt-one")
    for mode in (None, "parameters"):
        seeded, seeded_losses = kept(tmp_path / f"gpt-seeded-one-{mode}")
        assert any(not torch.equal(plain[k], seeded[k]) for k in plain)  # the seeds draw other numbers
        for world in (2, 4):
            got, got_losses = kept(tmp_path / f"gpt-seeded-{mode}-{world}")
            assert [k for k in seeded if not torch.equal(seeded[k], got[k])] == [], (mode, world)
            assert got_losses == seeded_losses
    # items of two shapes in one update: each shape counted once (2 forwards), one process's bits
    ref = json.loads((tmp_path / "odd-shapes-1.0.json").read_text())
    for world in (2, 4):
        for rank, got in enumerate(odd(tmp_path, "shapes", world)):
            assert got["values"] == ref["values"] and got["rng"] == ref["rng"], (world, rank)
            assert got["warnings"] == []
            assert got["forwards"] == 2 * 8 // world + 2
    # a cached normal sample cannot be counted: the replay, said once, one process's bits
    ref = json.loads((tmp_path / "odd-small_normal-1.0.json").read_text())
    for world in (2, 4):
        for rank, got in enumerate(odd(tmp_path, "small_normal", world)):
            assert got["values"] == ref["values"] and got["rng"] == ref["rng"], (world, rank)
            assert len(got["warnings"]) == 1 and "cached normal sample" in got["warnings"][0], got["warnings"]
    # the values decide how much a forward draws: refused by name (one process trains it as it is)
    assert "values" in json.loads((tmp_path / "odd-values-1.0.json").read_text())
    errors = [got["error"] for got in odd(tmp_path, "values", 2)]
    refused = [e for e in errors if e.startswith("DataError: item ")]
    assert refused and all("train_samples: its forward drew another amount of random numbers" in e
                           and "item_seeds=True" in e for e in refused), errors
    assert all(e in refused or e.startswith("CollectiveError") for e in errors), errors


def _splitmix(u: int, k: int) -> int:
    """The documented item seed (``runner/item_seeds.py``), written out again."""
    mask = (1 << 64) - 1
    z = (u + (k + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 1


@pytest.mark.parametrize("seeded", [False, True], ids=["defaults", "item_seeds"])
@pytest.mark.parametrize("model", ["gpt", "cnn_batchnorm"])
def test_one_process_draws_what_the_plain_loop_draws(model, seeded):
    """Against plain PyTorch on the same model, one process: each item's forward in turn,
    backward into ``.grad``, the sum times 1/n, ``AdamW(fused=True)``, the generator from
    seed 1 (agreement to rounding: ``.grad`` accumulation and the fold round alike only for
    the first two items). The defaults draw as that loop draws, the generator ending where
    it ends. ``item_seeds=True`` is the plain loop seeding each item: per update one number
    drawn from the CPU generator, each item's forward after ``torch.manual_seed(splitmix(u,
    k))``, then the generator put back just after the draw. BatchNorm's buffer pass draws
    each item's numbers too, as the plain loop's one forward per item does."""
    entry = cases.zoo_models.BY_NAME[model]
    samples = entry.samples(cases.STEPS * cases.BATCH)
    runner = lt.Runner(entry.model(0), entry.loss)
    torch.manual_seed(1)
    lt.train_samples(runner, lt.TrainConfig(steps=cases.STEPS, batch_size=cases.BATCH, log_every=0,
                                            optimizer=lt.optim.adamw(1e-2), measure_loss=False, item_seeds=seeded),
                     samples, log=None)
    ours_rng = torch.get_rng_state()
    plain = entry.model(0)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=lt.optim.adamw(1e-2).hyper.weight_decay,
                            fused=True)
    loss_fn = entry.loss_fn()
    torch.manual_seed(1)
    for step in range(cases.STEPS):
        if seeded:
            u = int(torch.randint(0, 1 << 62, (), dtype=torch.int64))
            after = torch.get_rng_state()
        opt.zero_grad(set_to_none=True)
        for k in range(cases.BATCH):
            if seeded:
                torch.manual_seed(_splitmix(u, k))
            x, y = samples[step * cases.BATCH + k]
            loss_fn(plain(x), y).backward()
        for p in plain.parameters():
            p.grad.mul_(1.0 / cases.BATCH)
        opt.step()
        if seeded:
            torch.set_rng_state(after)
    assert torch.equal(torch.get_rng_state(), ours_rng)  # the same draws, in the same order
    ours = runner.module.state_dict()
    for key, t in plain.state_dict().items():
        torch.testing.assert_close(ours[key], t, rtol=1e-5, atol=1e-6, msg=lambda m: f"{model} {key}: {m}")
