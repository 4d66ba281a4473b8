"""A run with every everyday feature on at once (gradient clipping, per-slot
hyperparameters, float16 autocast with loss scaling, a moving average evaluated on held-out
data, accumulation over loader batches), shared by its test and the fresh-process child.

Child usage: python all_features.py WORKDIR resumes WORKDIR/mid.ckpt into
WORKDIR/resumed.ckpt and writes WORKDIR/resumed.json.
"""

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

import leantrain as lt
from leantrain import optim
from resume_cases import Net, data


def per_slot(p):
    out = {"weight_decay": 0.0} if len(p.shape) < 2 else {}
    if p.name and p.name.endswith("bias"):
        out["lr_scale"] = 0.5
    return out


def make():
    torch.manual_seed(0)
    runner = lt.Runner.from_module(Net(), "mse")
    loader = lt.DataLoader(lt.Dataset(data() + data()[:2]), batch_size=1, shuffle=True, seed=4)
    cfg = lt.LoaderTrainConfig(
        epochs=3, optimizer=optim.adamw(0.01, 0.1).per_slot(per_slot), scheduler=optim.step(0.01, 1, 0.7),
        log_every=1, accumulate=2, clip_grad_norm=0.5, autocast="float16", ema_decay=0.9,
        eval_data=data()[:2], eval_ema=True,
    )
    return runner, lambda c, cb=None: lt.train_loader(runner, c, loader, log=lambda s: None, callback=cb)[0], cfg


if __name__ == "__main__":
    work = Path(sys.argv[1])
    torch.set_num_threads(int(os.environ.get("LEANTRAIN_THREADS", "1")))
    runner, run, cfg = make()
    report = run(replace(cfg, resume_from=work / "mid.ckpt", checkpoint_path=work / "resumed.ckpt"))
    fields = {"losses": report.losses, "steps": report.steps, "grad_norms": report.grad_norms,
              "evals": report.evals, "skipped": report.skipped_steps}
    (work / "resumed.json").write_text(json.dumps(fields))
