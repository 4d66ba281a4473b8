"""Loader kinds for the exact-resume tests, and their fresh-process child.

Child usage: python stream_cases.py WORKDIR PHASE CASE [CASE ...] with PHASE
``full`` (train uninterrupted; also stop at STEP with a checkpoint: CASE is KIND@STEP)
or ``resume`` (a fresh process: build the loader afresh and resume from the checkpoint).
Each writes WORKDIR/CASE.PHASE.pt: the parameters and buffers, the optimizer state's
tensors and the logged losses.
"""

import sys
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import Dataset as TorchDataset
from torch.utils.data import DistributedSampler, IterableDataset, SubsetRandomSampler, TensorDataset
from torch.utils.data import WeightedRandomSampler

import leantrain as lt
from leantrain import optim

N, BATCH, EPOCHS = 20, 3, 3  # 7 batches per epoch (the last one short), 21 updates


class Augmented(TorchDataset):
    """A map-style dataset whose items carry a random augmentation (global generator in
    the main process, the worker's seed in a worker)."""

    def __init__(self):
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(N, 4, generator=g), torch.randn(N, 2, generator=g)

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.x[i] + 0.01 * torch.randn(4), self.y[i]


def collate(items):
    """A custom collate: one stacked (x, y) minibatch."""
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


class Counting(IterableDataset):
    """A deterministic stream with a position it can save and restore."""

    def __init__(self):
        self.data = Augmented()
        self.position, self.resume_at = 0, 0

    def __iter__(self):
        start, self.resume_at = self.resume_at, 0  # a restored position is used once
        for i in range(start, N):
            self.position = i + 1
            yield self.data.x[i], self.data.y[i]

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.resume_at = state["position"]


class Plain(Counting):
    """The same stream without a saved position."""

    state_dict = None
    load_state_dict = None


def loader(kind):
    ds = Augmented()
    seeded = torch.Generator().manual_seed(7)
    if kind == "seeded":
        return TorchLoader(ds, batch_size=BATCH, shuffle=True, generator=seeded, collate_fn=collate)
    if kind == "unseeded":
        return TorchLoader(ds, batch_size=BATCH, shuffle=True, collate_fn=collate)
    if kind == "weighted":
        sampler = WeightedRandomSampler(torch.linspace(0.5, 2.0, N), N, generator=seeded)
        return TorchLoader(ds, batch_size=BATCH, sampler=sampler, collate_fn=collate)
    if kind == "subset":
        return TorchLoader(ds, batch_size=BATCH, sampler=SubsetRandomSampler(list(range(N))), collate_fn=collate)
    if kind == "distributed":  # rank 0 of 2, its shard; the loop calls set_epoch each epoch
        sampler = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=3)
        return TorchLoader(ds, batch_size=BATCH, sampler=sampler, collate_fn=collate, drop_last=True)
    if kind == "workers":
        return TorchLoader(ds, batch_size=BATCH, shuffle=True, generator=seeded, collate_fn=collate, num_workers=2)
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(ds, batch_size=BATCH, shuffle=True, generator=seeded, collate_fn=collate)
    if kind == "iterable":
        return TorchLoader(Counting(), batch_size=BATCH)
    if kind == "plain_iterable":
        return TorchLoader(Plain(), batch_size=BATCH)
    if kind == "tensor":
        return TorchLoader(TensorDataset(ds.x, ds.y), batch_size=BATCH, shuffle=True, generator=seeded)
    if kind == "leantrain":
        pairs = [(ds.x[[i, (i + 1) % N]], ds.y[[i, (i + 1) % N]]) for i in range(N)]  # two rows: BatchNorm
        return lt.DataLoader(lt.Dataset(pairs), batch_size=BATCH, shuffle=True, seed=3)
    raise ValueError(kind)


KINDS = ["seeded", "unseeded", "weighted", "subset", "distributed", "workers", "stateful", "iterable", "plain_iterable",
         "tensor", "leantrain"]


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Dropout(0.2), nn.Tanh(), nn.Linear(6, 2))


def config(**kw):
    return lt.LoaderTrainConfig(epochs=EPOCHS, optimizer=optim.adam(0.01), log_every=1,
                                scheduler=optim.warmup_cosine(0.01, 0.0, 3, 21), schedule_per="step", **kw)


def result(runner, report, path):
    state = lt.load_checkpoint(path, lt.Runner.from_module(model(), "mse"), optimizer=optim.adam(0.01),
                               restore_rng=False).state
    records = {i: {k: t for k, t in r.tensors().items()} for i, r in state.records().items()}
    return {"module": {k: v.clone() for k, v in runner.module.state_dict().items()},
            "losses": list(report.losses), "records": records, "steps": report.steps}


def run(workdir, phase, case):
    kind, _, stop = case.partition("@")
    workdir = Path(workdir)
    torch.manual_seed(1)
    r = lt.Runner.from_module(model(), "mse")
    out = {}
    if phase == "full":
        report, _ = lt.train_loader(r, config(checkpoint_path=workdir / f"{case}.full.ckpt"), loader(kind), log=lambda s: None)
        out = result(r, report, workdir / f"{case}.full.ckpt")
        torch.manual_seed(1)
        stopped = lt.Runner.from_module(model(), "mse")
        lt.train_loader(stopped, config(max_steps=int(stop), checkpoint_path=workdir / f"{case}.mid.ckpt"),
                        loader(kind), log=lambda s: None)
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report, _ = lt.train_loader(r, config(resume_from=workdir / f"{case}.mid.ckpt",
                                                  checkpoint_path=workdir / f"{case}.resumed.ckpt"),
                                        loader(kind), log=lambda s: None)
        out = result(r, report, workdir / f"{case}.resumed.ckpt")
        out["warnings"] = [str(w.message) for w in caught if "resuming" in str(w.message)]
    torch.save(out, workdir / f"{case}.{phase}.pt")


if __name__ == "__main__":
    for c in sys.argv[3:]:
        run(sys.argv[1], sys.argv[2], c)
