"""Runs for the item seeds test (#55, item 4): the zoo's GPT (dropout) and BatchNorm CNN
(a buffer pass and dropout) trained with ``exact_reduction`` unsharded, under
``"gradients"`` and under ``"parameters"``, counting the model's forwards per rank."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

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
                run(Path(out), model, f"{mode}-{world}", sharding=mode)
                dist.barrier()
        run(Path(out), "gpt", f"replay-{world}", item_seeds=False)
    finally:
        dist.destroy_process_group()
