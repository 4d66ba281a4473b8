"""A spawned worker whose ranks are given different numbers of items (tests/test_rank_agreement.py)."""

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import leantrain as lt


def outcome(out, rank, train) -> None:
    """Run ``train`` and write ``"trained"`` or the ``ConfigError``'s message to ``rank{rank}.json``."""
    try:
        train()
        result = "trained"
    except lt.ConfigError as e:
        result = str(e)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def worker(rank, world, init_file, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        r = lt.Runner.from_module(nn.Linear(3, 2), "mse")
        g = torch.Generator().manual_seed(1)
        samples = [(torch.randn(2, 3, generator=g), torch.randn(2, 2, generator=g)) for _ in range(6 + 2 * rank)]
        outcome(out, rank, lambda: lt.train_samples(r, lt.TrainConfig(steps=3, batch_size=2, log_every=0), samples))
    finally:
        dist.destroy_process_group()


class Dropping(nn.Module):
    """Dropout between two layers, and BatchNorm (buffers) when asked."""

    def __init__(self, bn):
        super().__init__()
        self.a = nn.Linear(3, 6, bias=not bn)  # a bias before BatchNorm gets only rounding noise
        self.norm = nn.BatchNorm1d(6) if bn else nn.Identity()
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(6, 2)

    def forward(self, x):
        return self.b(self.drop(torch.tanh(self.norm(self.a(x)))))


def dropout_run(bn, exact):
    """Four updates of five items each (an odd count: ranks get different shares)."""
    torch.manual_seed(0)
    r = lt.Runner.from_module(Dropping(bn), "mse")
    g = torch.Generator().manual_seed(1)
    samples = [(torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)) for _ in range(20)]
    torch.manual_seed(7)
    report = lt.train_samples(r, lt.TrainConfig(steps=4, batch_size=5, optimizer=lt.optim.adam(0.01), log_every=1,
                                                exact_reduction=exact), samples, log=lambda s: None)
    return {k: v.clone() for k, v in r.module.state_dict().items()}, list(report.losses), torch.get_rng_state()


def dropout_worker(rank, world, init_file, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        for bn in (False, True):
            for exact in (False, True):
                state, losses, rng = dropout_run(bn, exact)
                torch.save({"state": state, "losses": losses, "rng": rng}, Path(out, f"d{int(bn)}{int(exact)}.{rank}.pt"))
    finally:
        dist.destroy_process_group()


def dropout_resume_run(out, phase):
    """The exact-reduction dropout run (with BatchNorm), stopped after 2 of its 4 updates
    (``phase="stop"``) or resumed from there (``"resume"``); ``"full"``: uninterrupted."""
    torch.manual_seed(0)
    r = lt.Runner.from_module(Dropping(True), "mse")
    g = torch.Generator().manual_seed(1)
    samples = [(torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)) for _ in range(20)]
    torch.manual_seed(7)
    ckpt = Path(out, "dropout.ckpt")
    cfg = dict(batch_size=5, optimizer=lt.optim.adam(0.01), log_every=1, exact_reduction=True, checkpoint_path=ckpt)
    if phase == "stop":
        cfg.update(steps=2)
    elif phase == "resume":
        cfg.update(steps=4, resume_from=ckpt, checkpoint_path=Path(out, "resumed.ckpt"))
    else:
        cfg.update(steps=4, checkpoint_path=None)
    report = lt.train_samples(r, lt.TrainConfig(**cfg), samples, log=lambda s: None)
    return {k: v.clone() for k, v in r.module.state_dict().items()}, list(report.losses)


def dropout_resume_worker(rank, world, init_file, out, phase):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        state, losses = dropout_resume_run(out, phase)
        if rank == 0:
            torch.save({"state": state, "losses": losses}, Path(out, f"{phase}.pt"))
    finally:
        dist.destroy_process_group()


def resume_worker(rank, world, init_file, out):
    """A relaunch whose ranks see different checkpoint folders: rank 0's holds a
    checkpoint to resume (``ck{0}.ckpt``), rank 1's does not."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        r, samples, cfg = resume_job()
        mine = Path(out, f"ck{rank}.ckpt")
        resume = str(mine) if mine.exists() else None
        outcome(out, rank, lambda: lt.train_samples(r, lt.TrainConfig(**dict(cfg, resume_from=resume)), samples,
                                                    log=None))
    finally:
        dist.destroy_process_group()


def resume_job():
    """(runner, samples, config keys) of the relaunch case."""
    torch.manual_seed(0)
    r = lt.Runner.from_module(nn.Linear(3, 2), "mse")
    g = torch.Generator().manual_seed(1)
    samples = [(torch.randn(2, 3, generator=g), torch.randn(2, 2, generator=g)) for _ in range(8)]
    return r, samples, dict(steps=4, batch_size=2, log_every=0)
