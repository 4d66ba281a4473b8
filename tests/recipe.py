"""A torchvision-style classification recipe, two ways (#56): ``reference`` is our reduction of
torchvision's ``references/classification/train.py`` loop, in its order of operations
(per batch: forward, loss, ``zero_grad``, backward, clipping, ``step``, the EMA every N
batches with its warm-up reset; per epoch: ``lr_scheduler.step()``, evaluate the model,
evaluate the EMA); ``ours`` is the same recipe as a user writes it with leantrain. What we
adapted: a small BatchNorm CNN on generated 8x8 images instead of torchvision models and
ImageNet, one process (``RASampler`` without replicas: its epoch-seeded repeated
permutation), no AMP, no ``model_without_ddp``, ``torch.optim`` built on the model
and ported with ``optim.from_torch`` (so the implementation torch runs is the one
leantrain runs), the EMA evaluated by a small callback.
"""

from __future__ import annotations

import copy
import math
import random

import torch
from torch import nn
from torch.optim import swa_utils
from torch.utils.data import DataLoader, Sampler, TensorDataset

import leantrain as lt
from leantrain import optim
from leantrain.optim import lr_scheduler as L

EPOCHS, BATCH, CLASSES = 3, 4, 3
RECIPES = ("sgd-steplr", "sgd-smoothing-warmup-cosine-normwd-clip", "adamw-ema", "mixup-cutmix", "rasampler-exp")


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(4, CLASSES))


def images(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, CLASSES, (n,), generator=g))


class RASampler(Sampler):
    """torchvision's repeated-augmentation sampler, one replica: each epoch a permutation
    seeded by the epoch, every index repeated 3 times, the first ``len`` kept."""

    def __init__(self, n: int, repetitions: int = 3) -> None:
        self.n, self.repetitions, self.epoch = n, repetitions, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.epoch)
        order = torch.randperm(self.n, generator=g).tolist()
        return iter([i for i in order for _ in range(self.repetitions)][:self.n])

    def __len__(self) -> int:
        return self.n


def mix_collate(batch):
    """torchvision's RandomMixUp / RandomCutMix in the collate, drawing from Python's ``random``
    (as its v1 ``RandomChoice`` does): soft targets."""
    x = torch.stack([b[0] for b in batch])
    y = nn.functional.one_hot(torch.stack([b[1] for b in batch]), CLASSES).float()
    if random.random() < 0.5:
        lam = random.uniform(0.2, 0.8)
        if random.random() < 0.5:  # MixUp
            x = x.roll(1, 0).mul(1 - lam).add(x.mul(lam))
        else:  # CutMix: a box of the rolled batch pasted in
            side = int(8 * math.sqrt(1 - lam))
            r, c = random.randint(0, 8 - side), random.randint(0, 8 - side)
            x = x.clone()
            x[:, :, r:r + side, c:c + side] = x.roll(1, 0)[:, :, r:r + side, c:c + side]
            lam = 1 - side * side / 64
        y = y.roll(1, 0).mul(1 - lam).add(y.mul(lam))
    return x, y


def loaders(recipe: str):
    train, test = images(24, 1), images(8, 2)
    if recipe == "mixup-cutmix":
        train_loader = DataLoader(train, batch_size=BATCH, shuffle=True, collate_fn=mix_collate)
    elif recipe == "rasampler-exp":
        train_loader = DataLoader(train, batch_size=BATCH, sampler=RASampler(len(train)))
    else:
        train_loader = DataLoader(train, batch_size=BATCH, shuffle=True)
    return train_loader, DataLoader(test, batch_size=BATCH)


def criterion(recipe: str) -> nn.Module:
    return nn.CrossEntropyLoss(label_smoothing=0.1 if "smoothing" in recipe else 0.0)


def torch_optimizer(recipe: str, m: nn.Module, impl: str):
    flags = {"fused": True} if impl == "fused" else {}
    if recipe == "adamw-ema":
        return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.05, **flags)
    if "normwd" in recipe:  # torchvision's set_weight_decay: norm layers' parameters without decay
        norm = [p for mod in m.modules() if isinstance(mod, nn.BatchNorm2d) for p in mod.parameters()]
        rest = [p for p in m.parameters() if all(p is not q for q in norm)]
        groups = [{"params": rest, "weight_decay": 1e-4}, {"params": norm, "weight_decay": 0.0}]
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=1e-4, **flags)
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, **flags)


def scheduler(recipe: str, module, opt):
    """The recipe's epoch schedule, built by ``module`` (torch's lr_scheduler or leantrain's)."""
    if recipe == "sgd-smoothing-warmup-cosine-normwd-clip":
        return module.SequentialLR(opt, [module.LinearLR(opt, start_factor=0.1, total_iters=1),
                                         module.CosineAnnealingLR(opt, T_max=EPOCHS - 1)], milestones=[1])
    if recipe == "rasampler-exp":
        return module.ExponentialLR(opt, gamma=0.9)
    return module.StepLR(opt, step_size=1, gamma=0.5)


def ema_of(m: nn.Module):
    """torchvision's ``ExponentialMovingAverage``: an AveragedModel with its own average."""
    decay = 0.9

    def ema_avg(averaged, current, num_averaged):
        return decay * averaged + (1 - decay) * current

    return swa_utils.AveragedModel(m, avg_fn=ema_avg, use_buffers=True)


EMA_STEPS, WARMUP_EPOCHS, CLIP = 2, 1, 1.0


def _evaluate(m: nn.Module, crit: nn.Module, loader) -> float:
    m.eval()
    total, n = None, 0
    with torch.no_grad():
        for x, y in loader:
            loss = crit(m(x), y)
            total, n = (loss if total is None else total + loss), n + 1
    return float((total * (1.0 / n)).item())


def reference(recipe: str, impl: str) -> dict:
    torch.manual_seed(7)
    random.seed(7)
    m = model()
    train_loader, test_loader = loaders(recipe)
    crit = criterion(recipe)
    opt = torch_optimizer(recipe, m, impl)
    sched = scheduler(recipe, torch.optim.lr_scheduler, opt) if recipe != "adamw-ema" else None
    ema = ema_of(m) if recipe == "adamw-ema" else None
    evals, ema_evals, rates = [], [], []
    for epoch in range(EPOCHS):
        if hasattr(train_loader.sampler, "set_epoch"):
            train_loader.sampler.set_epoch(epoch)
        m.train()
        rates.append(opt.param_groups[0]["lr"])
        for i, (x, y) in enumerate(train_loader):
            loss = crit(m(x), y)
            opt.zero_grad()
            loss.backward()
            if "clip" in recipe:
                nn.utils.clip_grad_norm_(m.parameters(), CLIP)
            opt.step()
            if ema is not None and i % EMA_STEPS == 0:
                ema.update_parameters(m)
                if epoch < WARMUP_EPOCHS:
                    ema.n_averaged.fill_(0)
        if sched is not None:
            sched.step()
        evals.append(_evaluate(m, crit, test_loader))
        if ema is not None:
            ema_evals.append(_evaluate(ema, crit, test_loader))
    return {"weights": m.state_dict(), "ema": None if ema is None else ema.state_dict(), "evals": evals,
            "ema_evals": ema_evals, "rates": rates}


class EvaluateEMA(lt.Callback):
    """The user's few lines: torchvision evaluates the EMA model after the model, each epoch."""

    def __init__(self, averaging, crit, loader):
        self.averaging, self.crit, self.loader, self.evals = averaging, crit, loader, []

    def on_epoch_end(self, event):
        runner = lt.Runner.from_module(self.averaging.model, self.crit)
        self.evals.append(lt.evaluate(runner, self.loader, draws="advance")["loss"])


def ours(recipe: str, impl: str, checkpoint=None, resume_from=None, max_steps=None, draws="advance") -> dict:
    """The recipe as a user writes it with leantrain (the lines the porting guide shows)."""
    torch.manual_seed(7)
    random.seed(7)
    m = model()
    train_loader, test_loader = loaders(recipe)
    crit = criterion(recipe)
    opt, _ = optim.from_torch(torch_optimizer(recipe, m, impl), m)
    averaging = None
    if recipe == "adamw-ema":
        averaging = lt.Averaging(ema_of(m), every=EMA_STEPS, per_epoch=True,
                                 reset_until=WARMUP_EPOCHS * len(train_loader))
    cfg = lt.LoaderTrainConfig(
        epochs=EPOCHS, optimizer=opt, scheduler=None if recipe == "adamw-ema" else scheduler(recipe, L, opt),
        clip_grad_norm=CLIP if "clip" in recipe else None, eval_data=test_loader, eval_draws=draws,
        averaging=averaging, measure_loss=False, log_every=0, checkpoint_path=checkpoint, resume_from=resume_from,
        max_steps=max_steps)
    rates = []
    callbacks = [EvaluateEMA(averaging, crit, test_loader)] if averaging is not None else []
    report, _ = lt.train_loader(lt.Runner.from_module(m, crit), cfg, train_loader, log=None, callbacks=callbacks,
                                callback=lambda e: rates.append((e.step, e.state.lr)) and False)
    per_epoch = [lr for step, lr in rates if (step - 1) % len(train_loader) == 0]
    return {"weights": m.state_dict(), "ema": None if averaging is None else averaging.model.state_dict(),
            "evals": [r["loss"] for _, r in report.evals], "ema_evals": callbacks[0].evals if callbacks else [],
            "rates": per_epoch, "steps": report.steps}


def same(a: dict, b: dict) -> list[str]:
    """What differs between two runs' results (empty: bit for bit)."""
    out = [k for k in a["weights"] if not torch.equal(a["weights"][k], b["weights"][k])]
    if (a["ema"] is None) != (b["ema"] is None):
        out.append("ema kept")
    elif a["ema"] is not None:
        out += [f"ema.{k}" for k in a["ema"] if not torch.equal(a["ema"][k], b["ema"][k])]
    out += [k for k in ("evals", "ema_evals", "rates") if a[k] != b[k]]
    return out


if __name__ == "__main__":  # a fresh process: train (part of) a recipe, save its results
    import os
    import sys

    # the child rounds like the parent only with the parent's thread count (CPU matmul bits)
    torch.set_num_threads(int(os.environ["LEANTRAIN_THREADS"]))
    recipe, impl, path, out = sys.argv[1:5]
    steps = int(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[5] != "-" else None
    resume = path if len(sys.argv) > 6 and sys.argv[6] == "resume" else None
    result = ours(recipe, impl, checkpoint=path, resume_from=resume, max_steps=steps)
    torch.save(copy.deepcopy(result), out)
