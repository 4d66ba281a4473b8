"""Loaders read lazily: endless and read-once streams, bounded memory, no reads ahead or of
skipped items, max_steps, per-step schedules, bounded measuring passes."""

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import Dataset as TorchDataset
from torch.utils.data import IterableDataset

import leantrain as lt
from leantrain import optim


class Counted(TorchDataset):
    """A map-style dataset that counts the items read and tracks the batches alive."""

    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)
        self.reads = 0
        self.alive = weakref.WeakSet()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.reads += 1
        return self.x[i], self.y[i]

    def collate(self, items):
        x, y = torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])
        self.alive.add(x)
        return x, y


class Endless(IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(1)
        while True:
            yield torch.randn(4, generator=g), torch.randn(2, generator=g)


def runner():
    torch.manual_seed(0)
    return lt.Runner.from_module(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), "mse")


def test_an_endless_stream_trains_until_max_steps():
    report, _ = lt.train_loader(runner(), lt.LoaderTrainConfig(epochs=1, max_steps=7, log_every=0),
                                TorchLoader(Endless(), batch_size=5))
    assert report.steps == 7 and report.before is None and report.after is None


def test_batches_alive_at_once_do_not_grow_with_the_dataset():
    peaks = []
    gc.collect()
    gc.freeze()  # what existed before is not garbage: each collection below scans the loop's objects only
    try:
        for n in (60, 600):
            _train_and_watch(n, peaks)
    finally:
        gc.unfreeze()
    assert peaks[0] == peaks[1] <= 2  # the batch being trained (and the one a prefetch holds)


def _train_and_watch(n: int, peaks: list) -> None:
    """One epoch over ``n`` counted items, the items alive after each update appended to ``peaks`` (their most)."""
    ds = Counted(n)
    seen = []

    def watch(event):
        gc.collect()
        seen.append(len(ds.alive))

    lt.train_loader(runner(), lt.LoaderTrainConfig(epochs=1, log_every=0, measure_loss=False),
                    TorchLoader(ds, batch_size=6, shuffle=True, collate_fn=ds.collate), callback=watch)
    assert len(seen) == n // 6 and ds.reads == n  # every item read once, nothing read twice
    peaks.append(max(seen))


def test_resume_reads_no_item_of_the_batches_done(tmp_path):
    ds = Counted(30)
    loader = lambda: TorchLoader(ds, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(2),
                                 collate_fn=ds.collate)
    cfg = dict(epochs=1, log_every=0, measure_loss=False, checkpoint_path=tmp_path / "c.ckpt")
    lt.train_loader(runner(), lt.LoaderTrainConfig(max_steps=4, **cfg), loader())
    ds.reads = 0
    report, _ = lt.train_loader(runner(), lt.LoaderTrainConfig(resume_from=tmp_path / "c.ckpt", **cfg), loader())
    assert report.steps == 10 and ds.reads == 30 - 4 * 3  # only the batches still to do


def test_measuring_passes_read_at_most_measure_batches():
    ds = Counted(30)
    report, _ = lt.train_loader(runner(), lt.LoaderTrainConfig(epochs=1, log_every=0, measure_batches=2),
                                TorchLoader(ds, batch_size=3, collate_fn=ds.collate))
    assert ds.reads == 30 + 2 * 2 * 3  # the epoch, and two batches before and after
    assert report.before is not None and report.after is not None
    with pytest.raises(lt.ConfigError, match="measure_batches"):
        lt.LoaderTrainConfig(epochs=1, measure_batches=0)


def test_a_per_step_schedule_is_indexed_by_update():
    sched = optim.warmup_cosine(0.1, 0.0, 4, 20)
    rates = []
    ds = Counted(30)
    cfg = lt.LoaderTrainConfig(epochs=2, log_every=0, scheduler=sched, schedule_per="step", accumulate=2)
    report, _ = lt.train_loader(runner(), cfg, TorchLoader(ds, batch_size=3, collate_fn=ds.collate),
                                callback=lambda e: rates.append((e.step, e.state.lr)))
    assert report.steps == 10  # 5 updates per epoch (two batches each)
    assert rates == [(k + 1, sched.lr_at(k)) for k in range(10)]
    per_epoch = []
    with pytest.raises(lt.ConfigError, match="never leave its warm-up"):  # a horizon of 20 updates, per epoch
        lt.LoaderTrainConfig(epochs=2, log_every=0, scheduler=sched)
    sched = optim.warmup_cosine(0.1, 0.0, 1, 2)  # a horizon in epochs
    lt.train_loader(runner(), lt.LoaderTrainConfig(epochs=2, log_every=0, scheduler=sched),
                    TorchLoader(ds, batch_size=3, collate_fn=ds.collate),
                    callback=lambda e: per_epoch.append(e.state.lr))
    assert per_epoch == [sched.lr_at(0)] * 10 + [sched.lr_at(1)] * 10  # upstream's rule: per epoch
    with pytest.raises(lt.ConfigError, match="schedule_per"):
        lt.LoaderTrainConfig(epochs=1, schedule_per="update")


def test_max_steps_stops_mid_epoch_and_a_resume_continues_there(tmp_path):
    ds = Counted(30)
    loader = lambda: TorchLoader(ds, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(4),
                                 collate_fn=ds.collate)
    straight = runner()
    lt.train_loader(straight, lt.LoaderTrainConfig(epochs=2, log_every=0), loader())
    r = runner()
    report, _ = lt.train_loader(r, lt.LoaderTrainConfig(epochs=2, log_every=0, max_steps=13,
                                                        checkpoint_path=tmp_path / "c.ckpt"), loader())
    assert report.steps == 13 and not report.interrupted
    ck = lt.load_checkpoint(tmp_path / "c.ckpt", runner(), optimizer=optim.sgd(0.01))
    assert (ck.progress["epoch"], ck.progress["batch"]) == (1, 3)
    resumed = runner()
    lt.train_loader(resumed, lt.LoaderTrainConfig(epochs=2, log_every=0, resume_from=tmp_path / "c.ckpt"), loader())
    for a, b in zip(resumed.module.parameters(), straight.module.parameters()):
        assert torch.equal(a, b)


def test_evaluate_streams_its_data():
    ds = Counted(60)
    r = runner()
    got = lt.evaluate(r, TorchLoader(ds, batch_size=6, collate_fn=ds.collate))
    assert got["items"] == 10 and ds.reads == 60
    gen = ((x, y) for x, y in TorchLoader(ds, batch_size=6, collate_fn=ds.collate))  # read once
    assert lt.evaluate(r, gen)["loss"] == got["loss"]


def test_samplers_are_told_each_epoch():
    class Recording(torch.utils.data.DistributedSampler):
        calls = []

        def set_epoch(self, epoch):
            self.calls.append(epoch)
            super().set_epoch(epoch)

    ds = Counted(12)
    sampler = Recording(ds, num_replicas=2, rank=1, shuffle=True, seed=0)
    lt.train_loader(runner(), lt.LoaderTrainConfig(epochs=3, log_every=0, measure_loss=False),
                    TorchLoader(ds, batch_size=3, sampler=sampler, collate_fn=ds.collate))
    assert Recording.calls == [0, 1, 2]


def test_a_checkpoint_without_a_loader_position_resumes_and_says_what_differs(tmp_path):
    """Checkpoints of torch loaders written before positions were saved hold none."""
    ds = Counted(30)
    loader = lambda: TorchLoader(ds, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(2),
                                 collate_fn=ds.collate)
    r = runner()
    cfg = dict(epochs=1, log_every=0, measure_loss=False)
    lt.train_loader(r, lt.LoaderTrainConfig(max_steps=4, checkpoint_path=tmp_path / "c.ckpt", **cfg), loader())
    ck = lt.load_checkpoint(tmp_path / "c.ckpt", runner(), optimizer=optim.sgd(0.01))
    lt.save_checkpoint(tmp_path / "old.ckpt", r, state=ck.state, progress=ck.progress)  # no loader state
    with pytest.warns(UserWarning, match="holds no position for this loader.*4 batch"):
        report, _ = lt.train_loader(runner(), lt.LoaderTrainConfig(resume_from=tmp_path / "old.ckpt", **cfg), loader())
    assert report.steps == 10


def test_a_loader_whose_iterator_cannot_skip_by_index_resumes_by_reading(tmp_path):
    """A DataLoader subclass whose iterator has no index access: the done batches are
    read and dropped after the generators are back, still exact."""

    class Wrapped(TorchLoader):
        def __iter__(self):
            return (b for b in super().__iter__())

    ds = Counted(30)
    loader = lambda: Wrapped(ds, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(4),
                             collate_fn=ds.collate)
    straight = runner()
    lt.train_loader(straight, lt.LoaderTrainConfig(epochs=2, log_every=0), loader())
    lt.train_loader(runner(), lt.LoaderTrainConfig(epochs=2, log_every=0, max_steps=13,
                                                   checkpoint_path=tmp_path / "c.ckpt"), loader())
    resumed = runner()
    lt.train_loader(resumed, lt.LoaderTrainConfig(epochs=2, log_every=0, resume_from=tmp_path / "c.ckpt"), loader())
    for a, b in zip(resumed.module.parameters(), straight.module.parameters()):
        assert torch.equal(a, b)
