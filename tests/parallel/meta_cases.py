"""Cases for a model built on torch's meta device under ``sharding="parameters"`` (#55,
item 1): the zoo's tied GPT with a mask buffer and dropout, filled by a nanoGPT-style
``init_weights`` (the mask computed there, as a meta build computes nothing), on one
process or ``world`` gloo ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import leantrain as lt

sys.path.insert(0, str(Path(__file__).parent.parent / "zoo"))
import zoo_models  # noqa: E402

ENTRY = zoo_models.BY_NAME["gpt_persistent_mask"]
STEPS, BATCH = 4, 3


def gpt_init(m: nn.Module) -> None:
    """nanoGPT's ``_init_weights`` for the zoo GPT, and what its ``__init__`` computes."""
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight, mean=0.0, std=0.02)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)
    elif isinstance(m, zoo_models.CharGPT):
        nn.init.normal_(m.pos_emb, std=0.1)
        with torch.no_grad():
            m.tok_emb.weight.mul_(0.5)  # reads what the head's call wrote (each rank holds its ranges only)
            m.mask.copy_(torch.tril(torch.ones(zoo_models.BLOCK, zoo_models.BLOCK, dtype=torch.bool)))


def meta_model() -> nn.Module:
    with torch.device("meta"):
        return ENTRY.build()


def built_model() -> nn.Module:
    """The same model built on the CPU, then ``model.apply(gpt_init)`` from seed 1."""
    torch.manual_seed(5)
    model = ENTRY.build()
    torch.manual_seed(1)
    model.apply(gpt_init)
    return model


def config(path, **kw) -> lt.TrainConfig:
    base = dict(steps=STEPS, batch_size=BATCH, optimizer=lt.optim.adamw(1e-2, weight_decay=0.1), log_every=1,
                checkpoint_path=path)  # the defaults: dropout draws one process's numbers on any world
    return lt.TrainConfig(**dict(base, **kw))


def train_meta(path, **kw) -> lt.Runner:
    """The meta-built GPT, filled and trained under ``"parameters"`` (seed 1 before the fill)."""
    runner = lt.Runner(meta_model(), ENTRY.loss)
    torch.manual_seed(1)
    lt.train_samples(runner, config(path, sharding="parameters", init_weights=gpt_init, **kw), ENTRY.samples(7),
                     log=None)
    return runner


def resume_meta(path, source) -> lt.Runner:
    """The meta-built GPT resumed from ``source`` (nothing filled by an init: all from the file)."""
    runner = lt.Runner(meta_model(), ENTRY.loss)
    lt.train_samples(runner, config(path, sharding="parameters", resume_from=source), ENTRY.samples(7), log=None)
    return runner


def worker(rank: int, world: int, init_file: str, out: str, tasks: list) -> None:
    """``tasks``: ``"meta"`` (the run, its result in ``meta-<world>``), ``"whole"`` (with
    ``gather_at_end``: rank 0 saves the module's state to ``whole-<world>.pt``), ``"part"``
    (its first 2 updates, ``part-<world>``), ``"resume:<folder>"`` (from that folder, to
    ``resumed-<folder>-<world>``)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        out = Path(out)
        for task in tasks:
            if task == "meta":
                train_meta(out / f"meta-{world}")
            elif task == "whole":
                runner = train_meta(out / f"meta-whole-{world}", gather_at_end=True)
                if rank == 0:
                    torch.save({k: v.clone() for k, v in runner.module.state_dict().items()}, out / f"whole-{world}.pt")
            elif task == "part":
                train_meta(out / f"part-{world}", steps=2)
            else:
                source = task.partition(":")[2]
                resume_meta(out / f"resumed-{source}-{world}", out / source)
            dist.barrier()
    finally:
        dist.destroy_process_group()
