"""A training run that checkpoints every step; the crash test kills it at random times."""

from dataclasses import replace

import torch
from torch import nn

import leantrain as lt
from leantrain import optim

STEPS = 30


def make():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 1024), nn.Tanh(), nn.Linear(1024, 256), nn.Tanh(), nn.Linear(256, 4))
    runner = lt.Runner.from_module(net, "mse")
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 64, generator=g), torch.randn(8, 4, generator=g)) for _ in range(5)]
    cfg = lt.TrainConfig(steps=STEPS, batch_size=2, optimizer=optim.adam(0.01), log_every=0)
    return runner, cfg, data


def train_and_checkpoint(path: str) -> None:
    torch.set_num_threads(1)
    runner, cfg, data = make()
    lt.train_samples(runner, replace(cfg, checkpoint_every=1, checkpoint_path=path), data, log=lambda s: None)


def resume(path: str) -> list[torch.Tensor]:
    runner, cfg, data = make()
    lt.train_samples(runner, replace(cfg, resume_from=path, checkpoint_every=1, checkpoint_path=path), data,
                     log=lambda s: None)
    return runner.params.values()


def straight() -> list[torch.Tensor]:
    runner, cfg, data = make()
    lt.train_samples(runner, cfg, data, log=lambda s: None)
    return runner.params.values()
