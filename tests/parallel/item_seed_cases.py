"""Runs for the dropout-across-world-sizes tests (``test_item_seeds.py``): the zoo's GPT
(dropout) and BatchNorm CNN (a buffer pass and dropout) trained with ``exact_reduction``
unsharded, under ``"gradients"`` and under ``"parameters"``, with the default settings
(each item draws what it draws in one process) and with ``item_seeds=True``; models whose
draws the counting cannot line up; each rank's model forwards counted."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import leantrain as lt

sys.path.insert(0, str(Path(__file__).parent.parent / "zoo"))
import zoo_models  # noqa: E402

MODELS = ("gpt", "cnn_batchnorm")
MODES = (None, "gradients", "parameters")
STEPS, BATCH = 3, 8


def run(out: Path, model: str, tag: str, **kw) -> None:
    """Train; the checkpoint goes to ``<model>-<tag>``, each rank's forward count to
    ``<model>-<tag>.forwards<rank>``."""
    entry = zoo_models.BY_NAME[model]
    runner = lt.Runner(entry.model(0), entry.loss)
    torch.manual_seed(1)
    forwards = [0]
    hook = runner.module.register_forward_pre_hook(lambda m, a: forwards.__setitem__(0, forwards[0] + 1))
    cfg = lt.TrainConfig(steps=STEPS, batch_size=BATCH, optimizer=lt.optim.adamw(1e-2), log_every=1,
                         measure_loss=False, exact_reduction=True, checkpoint_path=out / f"{model}-{tag}", **kw)
    lt.train_samples(runner, cfg, entry.samples(STEPS * BATCH), log=None)
    hook.remove()
    rank = dist.get_rank() if dist.is_initialized() else 0
    (out / f"{model}-{tag}.forwards{rank}").write_text(str(forwards[0]))


def worker(rank: int, world: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        for model in MODELS:
            for mode in MODES:
                run(Path(out), model, f"{mode}-{world}", sharding=mode)  # the defaults
                dist.barrier()
        for mode in (None, "parameters"):
            run(Path(out), "gpt", f"seeded-{mode}-{world}", sharding=mode, item_seeds=True)
            dist.barrier()
        for kind in ("shapes", "small_normal"):
            odd_run(Path(out), kind)
            dist.barrier()
        if world == 2:  # last: a rank whose item drew otherwise raises and leaves; its peer's collective fails
            odd_run(Path(out), "values")
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- models the counting does not fit
class ShapedDropout(nn.Module):
    """Dropout over items of two lengths (rows): each shape's draws counted once."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(5, 16), nn.Dropout(0.3), nn.Linear(16, 2)

    def forward(self, x):
        return self.b(self.drop(torch.tanh(self.a(x)))).mean(0, keepdim=True)


class SmallNormal(ShapedDropout):
    """Noise of fewer than 16 values (torch keeps a cached normal sample): not countable."""

    def forward(self, x):
        return super().forward(x) + 0.01 * torch.randn(1, 1)  # one value: half a pair, the other cached


class ValueDraws(ShapedDropout):
    """Draws as many numbers as the input's first value says (the values decide)."""

    def forward(self, x):
        n = 1 + int(x[0, 0].abs() * 40) % 7 * 16
        return super().forward(x) + 0.0 * torch.rand(n).sum()


ODD = {"shapes": ShapedDropout, "small_normal": SmallNormal, "values": ValueDraws}


def odd_samples(kind: str) -> list:
    g = torch.Generator().manual_seed(3)
    rows = [2, 5, 2, 2, 5, 5, 2, 5] * 2  # two shapes in each update
    return [(torch.randn(r, 5, generator=g), torch.randn(1, 2, generator=g)) for r in rows]


def odd_run(out: Path, kind: str) -> None:
    """Two updates of eight items; writes ``odd-<kind>-<world>.<rank>.json``: the outcome
    (the module's values, or the error), the warnings and the forward count."""
    torch.manual_seed(0)
    runner = lt.Runner(ODD[kind](), "mse")
    forwards = [0]
    runner.module.register_forward_pre_hook(lambda m, a: forwards.__setitem__(0, forwards[0] + 1))
    torch.manual_seed(4)
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    result: dict = {}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            lt.train_samples(runner, lt.TrainConfig(steps=2, batch_size=8, optimizer=lt.optim.adam(0.01), log_every=1,
                                                    exact_reduction=True, measure_loss=False),
                             odd_samples(kind), log=None)
            result["values"] = {k: v.flatten().tolist() for k, v in runner.module.state_dict().items()}
            result["rng"] = torch.get_rng_state().tolist()
        except lt.LeantrainError as e:
            result["error"] = f"{type(e).__name__}: {e}"
    result["warnings"] = [str(w.message) for w in seen if "random numbers" in str(w.message)]
    result["forwards"] = forwards[0]
    Path(out, f"odd-{kind}-{world}.{rank}.json").write_text(json.dumps(result))
