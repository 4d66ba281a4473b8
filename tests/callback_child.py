"""The resumed half of the callback resume test, in a fresh process.

Usage: python callback_child.py WORKDIR: resumes WORKDIR/c.ckpt with an EarlyStopping
and a JSONLLogger on WORKDIR/m.jsonl, and writes WORKDIR/resumed.json."""

import json
import sys
from pathlib import Path

import torch
from torch import nn

import leantrain as lt
from leantrain import optim


def runner():
    torch.manual_seed(0)
    return lt.Runner.from_module(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), "mse")


def data(n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)) for _ in range(n)]


def config(work, **kw):
    # lr so large that the evaluation loss rises: EarlyStopping must stop the run
    return lt.TrainConfig(steps=30, batch_size=2, optimizer=optim.sgd(2.0), log_every=1, eval_data=data(3, 9),
                          eval_every=1, checkpoint_path=Path(work) / "c.ckpt", checkpoint_every=1, **kw)


if __name__ == "__main__":
    work = Path(sys.argv[1])
    stopper = lt.EarlyStopping(patience=2)
    report = lt.train_samples(runner(), config(work, resume_from=work / "c.ckpt"), data(),
                              callbacks=[stopper, lt.JSONLLogger(work / "m.jsonl")], log=lambda s: None)
    (work / "resumed.json").write_text(json.dumps({"stopped_step": stopper.stopped_step, "steps": report.steps}))
