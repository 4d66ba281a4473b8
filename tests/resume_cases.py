"""Runs shared by the exact-resume tests and their fresh-process child.

Child usage: python resume_cases.py WORKDIR CASE [CASE ...] resumes each case from
WORKDIR/CASE.mid and writes WORKDIR/CASE.resumed.
"""

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

import leantrain as lt
from leantrain import optim
from optimizer_table import TABLE

K, M = 5, 7  # steps (in-memory) or batches (loader) before and after the save

OPTIMIZERS = {name: case.make for name, case in TABLE.items()}  # the shared table


def cases():
    out = []
    for name in OPTIMIZERS:
        for sched in ("none", "sched"):
            for loop in ("samples", "loader"):
                out.append(f"{loop}-{name}-{sched}")
    return out


class Net(nn.Module):
    """Tied weights, a frozen parameter, BatchNorm buffers and dropout (RNG)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 5)
        self.norm = nn.BatchNorm1d(5)
        self.drop = nn.Dropout(0.3)
        self.b = nn.Linear(5, 5)
        self.c = nn.Linear(5, 5)
        self.c.weight = self.b.weight
        self.head = nn.Linear(5, 2)
        self.head.bias.requires_grad_(False)

    def forward(self, x):
        h = self.drop(torch.tanh(self.norm(self.a(x))))
        return self.head(torch.tanh(self.c(torch.tanh(self.b(h)))))


def data():
    g = torch.Generator().manual_seed(123)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)) for _ in range(5)]


def make_loader():
    return lt.DataLoader(lt.Dataset(data() + data()[:1]), batch_size=2, shuffle=True, seed=4)


def make(case: str, **extra):
    loop, name, sched = case.split("-")
    torch.manual_seed(0)
    runner = lt.Runner.from_module(Net(), "mse")
    opt = OPTIMIZERS[name]()
    total = K + M
    schedule = None
    if sched == "sched":
        schedule = optim.warmup_cosine(opt.lr, opt.lr / 10, 2, total) if loop == "samples" else optim.step(opt.lr, 1, 0.7)
    if loop == "samples":
        cfg = lt.TrainConfig(steps=total, batch_size=2, optimizer=opt, scheduler=schedule, log_every=3, **extra)
        return runner, lambda c: lt.train_samples(runner, c, data(), log=lambda s: None), cfg
    loader = make_loader()
    # 6 items in batches of 2: 3 updates per epoch; K + M = 12 updates is 4 epochs
    cfg = lt.LoaderTrainConfig(epochs=total // 3, optimizer=opt, scheduler=schedule, log_every=3, **extra)
    return runner, lambda c: lt.train_loader(runner, c, loader, log=lambda s: None)[0], cfg


def resume(workdir: Path, case: str) -> lt.TrainReport:
    from dataclasses import replace

    runner, run, cfg = make(case)
    return run(replace(cfg, resume_from=workdir / f"{case}.mid", checkpoint_path=workdir / f"{case}.resumed"))


if __name__ == "__main__":
    work = Path(sys.argv[1])
    torch.set_num_threads(int(os.environ.get("LEANTRAIN_THREADS", "1")))
    for case in sys.argv[2:]:
        report = resume(work, case)
        fields = {"before": report.before, "after": report.after, "losses": report.losses, "steps": report.steps}
        (work / f"{case}.report").write_text(json.dumps(fields))
