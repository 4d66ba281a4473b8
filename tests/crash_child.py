"""A training run that checkpoints every step, and the points where the crash test kills
it: between steps, or inside a checkpoint write (the scratch file half written, written
but not yet renamed, renamed but the folder not yet synced). The kill is a SIGKILL the
child sends itself at that exact point: no timing is involved."""

import os
import signal
from dataclasses import replace

import torch
from torch import nn

import leantrain as lt
from leantrain import optim

STEPS = 12
STAGES = ("between-steps", "half-written", "before-rename", "after-rename")


def make():
    torch.set_num_threads(1)  # the child and the parent must round alike
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.BatchNorm1d(64), nn.Linear(64, 4))
    runner = lt.Runner.from_module(net, "mse")
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(5)]
    cfg = lt.TrainConfig(steps=STEPS, batch_size=2, optimizer=optim.adam(0.01), log_every=3)
    return runner, cfg, data


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def train_and_checkpoint(path: str, kill_step: int, stage: str) -> None:
    """Train, saving after every step; die at ``stage`` of step ``kill_step``."""
    from leantrain.io import atomic, checkpoint

    at = {"step": 0}

    def callback(event):
        at["step"] = event.step
        if event.step == kill_step and stage == "between-steps":
            _die()  # after the update, before its checkpoint

    real_save, real_replace = checkpoint.save_file, os.replace

    def save_file(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        if at["step"] == kill_step and stage == "half-written":
            size = os.path.getsize(filename)
            with open(filename, "r+b") as f:
                f.truncate(size // 2)
            _die()

    def replace_file(src, dst):
        if at["step"] == kill_step and stage == "before-rename":
            _die()
        real_replace(src, dst)
        if at["step"] == kill_step and stage == "after-rename":
            _die()

    checkpoint.save_file = save_file
    atomic.os.replace = replace_file
    runner, cfg, data = make()
    lt.train_samples(runner, replace(cfg, checkpoint_every=1, checkpoint_path=path), data,
                     log=lambda s: None, callback=callback)


def resume(path: str):
    runner, cfg, data = make()
    report = lt.train_samples(runner, replace(cfg, resume_from=path, checkpoint_every=1, checkpoint_path=path),
                              data, log=lambda s: None)
    return runner.params.values(), report.losses


def straight():
    runner, cfg, data = make()
    report = lt.train_samples(runner, cfg, data, log=lambda s: None)
    return runner.params.values(), report.losses
