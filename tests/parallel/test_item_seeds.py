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

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")


def kept(path) -> tuple[dict, list]:
    manifest, tensors = lt.read_checkpoint(path)
    return {k: t for k, t in tensors.items() if k.startswith(("storage.", "state."))}, manifest["progress"]["losses"]


def forwards(tmp_path, name: str, world: int) -> list[int]:
    return [int((tmp_path / f"{name}.forwards{r}").read_text()) for r in range(world)]


@pytest.mark.slow
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


def _splitmix(u: int, k: int) -> int:
    """The documented item seed (``runner/item_seeds.py``), written out again."""
    mask = (1 << 64) - 1
    z = (u + (k + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 1


@pytest.mark.parametrize("model", ["gpt", "cnn_batchnorm"])
def test_item_seeds_in_one_process_are_a_plain_loop_seeding_each_item(model):
    """Against plain PyTorch on the same model: per update one number drawn from the CPU
    generator, each item's forward after ``torch.manual_seed(splitmix(u, k))``, backward into
    ``.grad``, the sum times 1/n, ``AdamW(fused=True)``, then the generator put back just
    after the draw (agreement to rounding: ``.grad`` accumulation and the fold round alike
    only for the first two items). BatchNorm's buffer pass draws each item's seeded numbers
    too, as the plain loop's one forward per item does."""
    entry = cases.zoo_models.BY_NAME[model]
    samples = entry.samples(cases.STEPS * cases.BATCH)
    runner = lt.Runner(entry.model(0), entry.loss)
    torch.manual_seed(1)
    lt.train_samples(runner, lt.TrainConfig(steps=cases.STEPS, batch_size=cases.BATCH, log_every=0,
                                            optimizer=lt.optim.adamw(1e-2), measure_loss=False, item_seeds=True),
                     samples, log=None)
    plain = entry.model(0)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=lt.optim.adamw(1e-2).hyper.weight_decay,
                            fused=True)
    loss_fn = entry.loss_fn()
    torch.manual_seed(1)
    for step in range(cases.STEPS):
        u = int(torch.randint(0, 1 << 62, (), dtype=torch.int64))
        after = torch.get_rng_state()
        opt.zero_grad(set_to_none=True)
        for k in range(cases.BATCH):
            torch.manual_seed(_splitmix(u, k))
            x, y = samples[step * cases.BATCH + k]
            loss_fn(plain(x), y).backward()
        for p in plain.parameters():
            p.grad.mul_(1.0 / cases.BATCH)
        opt.step()
        torch.set_rng_state(after)
    ours = runner.module.state_dict()
    for key, t in plain.state_dict().items():
        torch.testing.assert_close(ours[key], t, rtol=1e-5, atol=1e-6, msg=lambda m: f"{model} {key}: {m}")
