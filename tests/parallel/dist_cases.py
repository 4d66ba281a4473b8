"""Runs shared by the data-parallel tests (imported by spawned workers)."""

from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import leantrain as lt
from leantrain import optim
from optimizer_table import TABLE

STOP = 3  # stop (and save) after this many updates in the resume cases


class Net(nn.Module):
    """Tied weights, a frozen parameter and BatchNorm buffers."""

    def __init__(self, dtype):
        super().__init__()
        self.a = nn.Linear(3, 6, bias=False)  # a bias before BatchNorm gets only rounding noise
        self.norm = nn.BatchNorm1d(6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 6)
        self.c.weight = self.b.weight
        self.head = nn.Linear(6, 2)
        self.head.bias.requires_grad_(False)
        self.to(dtype)

    def features(self, x):
        return torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.norm(self.a(x)))))))

    def forward(self, x):
        return self.head(self.features(x))


class Mixed(Net):
    """``Net`` in float32 with a float64 head: two gradient buckets (one per dtype)."""

    def __init__(self):
        super().__init__(torch.float32)
        self.head.to(torch.float64)

    def forward(self, x):
        return self.head(self.features(x).double()).float()


def data(dtype):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(4, 3, generator=g).to(dtype), torch.randn(4, 2, generator=g).to(dtype)) for _ in range(7)]


CASES = [f"{loop}-{kind}-{dt}" for loop in ("samples", "loader") for kind in ("sgd", "adam") for dt in ("f64", "f32")]
CASES += ["samples-adam-f64-mirrors", "loader-sgd-f32-mirrors"]  # the native path on CPU mirrors
EXACT_CASES = ["samples-adam-f32-exact", "loader-sgd-f32-exact"]  # exact_reduction
# and with segments of 64 bytes: each round's gradient crosses in several segments, slots
# straddling them, with the send and receive buffers reused from segment to segment (and,
# "mixed", across a float32 and a float64 bucket)
EXACT_CASES += ["loader-adam-f32-exact-segments", "samples-sgd-mixed-exact-segments"]


def make(case):
    loop, kind, dt = case.split("-")[:3]
    dtype = torch.float64 if dt == "f64" else torch.float32
    torch.manual_seed(1)
    runner = lt.Runner.from_module(Mixed() if dt == "mixed" else Net(dtype), "mse")
    if case.endswith("-mirrors"):
        runner.to("cpu")
    opt = TABLE[kind].make()  # the shared table's setting
    exact = dict(exact_reduction=True, log_every=1) if "-exact" in case else {}
    if loop == "samples":  # batches of 3 items: ranks get 2 and 1
        cfg = replace(lt.TrainConfig(steps=8, batch_size=3, optimizer=opt, log_every=4), **exact)
        return runner, cfg, lambda c, cb=None: lt.train_samples(runner, c, data(dtype), log=lambda s: None, callback=cb)
    # 7 items in batches of 3: the last batch has one item, so rank 1 gets none
    loader = lt.DataLoader(lt.Dataset(data(dtype)), batch_size=3, shuffle=True, seed=2)
    cfg = replace(lt.LoaderTrainConfig(epochs=3, optimizer=opt, log_every=4), **exact)
    return runner, cfg, lambda c, cb=None: lt.train_loader(runner, c, loader, log=lambda s: None, callback=cb)[0]


def run(case, out: Path, tag: str, resume: bool = False, stop: bool = False):
    from leantrain.training.parallel import exact_fold

    segment = exact_fold.SEGMENT_BYTES
    if case.endswith("-segments"):
        exact_fold.SEGMENT_BYTES = 64
    try:
        _run(case, out, tag, resume, stop)
    finally:
        exact_fold.SEGMENT_BYTES = segment


def _run(case, out: Path, tag: str, resume: bool, stop: bool):
    runner, cfg, go = make(case)
    cfg = replace(cfg, checkpoint_path=out / f"{case}.{tag}")
    if resume:
        cfg = replace(cfg, resume_from=out / f"{case}.stopped")
    if stop:
        cfg = replace(cfg, checkpoint_path=out / f"{case}.stopped")
    go(cfg, (lambda ev: ev.step == STOP) if stop else None)


def worker(rank, world, init_file, out, plan):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        for case, tag, resume, stop in plan:
            run(case, Path(out), tag, resume, stop)
            dist.barrier()
    finally:
        dist.destroy_process_group()
