"""A run that keeps a folder of checkpoints (the last 2 and the best 1 by an evaluation),
and the points where the crash test kills it inside a save: the new file half written,
written but not renamed, renamed but nothing older pruned yet, and between two deletions
of the pruning. The kill is a SIGKILL the child sends itself at that exact point."""

import os
import signal

import torch
from torch import nn

import leantrain as lt
from leantrain import optim

STEPS = 10
STAGES = ("half-written", "before-rename", "before-prune", "mid-prune")


def make(folder):
    torch.set_num_threads(1)  # the child and the parent must round alike
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.BatchNorm1d(16), nn.Linear(16, 3))
    runner = lt.Runner.from_module(net, "mse")
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(5)]
    held = [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(2)]
    cfg = lt.TrainConfig(steps=STEPS, batch_size=2, optimizer=optim.adam(0.05), log_every=1, eval_data=held,
                         eval_every=3, checkpoint_every=1, checkpoint_path=os.path.join(folder, "step{step}.ckpt"),
                         keep_last=2, keep_best=1, resume_from="auto")
    return runner, cfg, data


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def train_and_die(folder: str, kill_step: int, stage: str) -> None:
    from leantrain.io import atomic, checkpoint
    from leantrain.training.loops import checkpoint_folder

    at = {"step": 0}
    real_save, real_replace, real_read = checkpoint.save_file, os.replace, checkpoint_folder.read_checkpoint

    def callback(event):
        at["step"] = event.step

    def save_file(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        if at["step"] == kill_step and stage == "half-written":
            with open(filename, "r+b") as f:
                f.truncate(os.path.getsize(filename) // 2)
            _die()

    def replace_file(src, dst):
        if at["step"] == kill_step and stage == "before-rename":
            _die()
        real_replace(src, dst)

    def verify(path, op):
        out = real_read(path, op)
        if at["step"] == kill_step and stage == "before-prune":
            _die()
        return out

    real_unlink = type(checkpoint_folder.Path()).unlink

    def unlink(self, missing_ok=False):
        real_unlink(self, missing_ok=missing_ok)
        if at["step"] == kill_step and stage == "mid-prune":
            _die()  # one older file deleted, the others not yet

    checkpoint.save_file = save_file
    atomic.os.replace = replace_file
    checkpoint_folder.read_checkpoint = verify
    type(checkpoint_folder.Path()).unlink = unlink
    runner, cfg, data = make(folder)
    lt.train_samples(runner, cfg, data, log=lambda s: None, callback=callback)


def run(folder: str):
    runner, cfg, data = make(folder)
    report = lt.train_samples(runner, cfg, data, log=lambda s: None)
    return runner.params.values(), report


def straight(folder: str):
    return run(folder)
