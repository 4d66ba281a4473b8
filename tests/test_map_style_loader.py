"""``leantrain.DataLoader`` over any map-style dataset: items read by index when their batch
is reached (never copied, never read ahead of the workers' prefetch), the same seeded order
as an in-memory list, ``num_workers`` processes giving the same batches, and a job with
random augmentation in the workers, stopped mid-epoch and resumed, bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import leantrain as lt


class Augmented(torch.utils.data.Dataset):
    """Items made on read, with random noise drawn from torch's generator (augmentation)."""

    def __init__(self, n: int = 24, noise: float = 0.1) -> None:
        self.n, self.noise, self.reads = n, noise, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.reads += 1
        g = torch.Generator().manual_seed(i)
        x = torch.randn(4, generator=g) + self.noise * torch.randn(4)
        return x, torch.randn(1, generator=g)


def _ids(batches):
    return [[round(float(x[0].sum()), 4) for x in b] for b in batches]


def test_the_same_order_and_batches_as_an_in_memory_list_with_or_without_workers():
    plain = Augmented(noise=0.0)
    listed = [plain[i] for i in range(len(plain))]
    a = lt.DataLoader(listed, batch_size=5, shuffle=True, seed=7, drop_last=True)
    b = lt.DataLoader(Augmented(noise=0.0), batch_size=5, shuffle=True, seed=7, drop_last=True)
    c = lt.DataLoader(Augmented(noise=0.0), batch_size=5, shuffle=True, seed=7, drop_last=True, num_workers=2,
                      prefetch_factor=1)
    for _ in range(2):  # the order persists across epochs, as in memory
        a, ba = a.epoch()
        b, bb = b.epoch()
        c, bc = c.epoch()
        assert _ids(ba) == _ids(bb) == _ids(bc)
        assert all(torch.equal(x[0], y[0]) for p, q in zip(ba, bc) for x, y in zip(p, q))
    assert len(b) == 4


def test_items_are_read_when_their_batch_is_reached_never_copied():
    data = Augmented()
    loader = lt.DataLoader(data, batch_size=6, shuffle=True)
    assert data.reads == 0
    _, batches = loader.epoch_batches("t")
    next(batches)
    assert data.reads == 6  # one batch, nothing ahead
    _, batches = loader.epoch_batches("t", skip=3)
    next(batches)
    assert data.reads == 12  # the skipped batches were not read


def test_a_collate_and_a_rank_share_apply_as_in_memory():
    loader = lt.DataLoader(Augmented(noise=0.0), batch_size=4, rank=1, world_size=2,
                           collate=lambda items: (torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])))
    _, batches = loader.epoch()
    x, y = batches[0][0]
    data = Augmented(noise=0.0)
    assert torch.equal(x, torch.stack([data[1][0], data[3][0]]))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_job_with_augmentation_stopped_mid_epoch_resumes_bit_for_bit(tmp_path, workers):
    def run(max_steps, resume=None):
        torch.manual_seed(0)
        runner = lt.Runner.from_module(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), "mse")
        loader = lt.DataLoader(Augmented(), batch_size=4, shuffle=True, seed=1, num_workers=workers)
        cfg = lt.LoaderTrainConfig(epochs=2, max_steps=max_steps, optimizer=lt.optim.adamw(0.01),
                                   checkpoint_path=tmp_path / f"c{max_steps}.ckpt", checkpoint_every=1,
                                   resume_from=resume, log_every=1)
        report, _ = lt.train_loader(runner, cfg, loader, log=None)
        return runner, report

    whole, report = run(12)
    run(8)  # stopped in the second epoch, after 2 of its 6 updates
    (tmp_path / "c8.ckpt").rename(tmp_path / "c12.ckpt")
    resumed, rest = run(12, resume=tmp_path / "c12.ckpt")
    assert all(torch.equal(a, b) for a, b in zip(whole.module.state_dict().values(),
                                                 resumed.module.state_dict().values()))
    assert rest.losses == report.losses  # the resumed report carries the first 8 updates' losses too


def test_workers_draw_the_same_augmentation_on_every_run():
    def draws():
        loader = lt.DataLoader(Augmented(), batch_size=4, shuffle=True, num_workers=2)
        _, batches = loader.epoch()
        return torch.cat([x for b in batches for x, _ in b])

    first, second = draws(), draws()
    assert torch.equal(first, second)
    assert not torch.equal(first, torch.cat([Augmented(noise=0.0)[0][0]] * 24))  # noise was drawn


@pytest.mark.parametrize("bad, message", [
    (dict(num_workers=-1), "num_workers"),
    (dict(prefetch_factor=2), "prefetch_factor needs num_workers"),
    (dict(pin_memory="yes"), "pin_memory"),
])
def test_bad_worker_settings_are_config_errors(bad, message):
    with pytest.raises(lt.ConfigError, match=message):
        lt.DataLoader(Augmented(), batch_size=2, **bad)


def test_an_iterable_only_dataset_is_refused_with_what_is_accepted():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(lt.ConfigError, match="map-style dataset"):
        lt.DataLoader(Stream(), batch_size=2)


def test_a_hugging_face_datasets_dataset_is_read_row_by_row_in_the_seeded_order():
    datasets = pytest.importorskip("datasets")
    rows = {"x": [[float(i)] * 4 for i in range(12)], "y": [[float(i)] for i in range(12)]}
    table = datasets.Dataset.from_dict(rows).with_format("torch")

    def pairs(items):
        return [(r["x"], r["y"]) for r in items]

    loader = lt.DataLoader(table, batch_size=4, shuffle=True, seed=5, collate=pairs)
    listed = lt.DataLoader([(torch.tensor(rows["x"][i]), torch.tensor(rows["y"][i])) for i in range(12)],
                           batch_size=4, shuffle=True, seed=5)
    assert loader.lazy  # the rows stay in the Arrow table
    _, ours = loader.epoch()
    _, theirs = listed.epoch()
    assert [[float(y) for _, y in b] for b in ours] == [[float(y) for _, y in b] for b in theirs]
    runner = lt.Runner.from_module(nn.Linear(4, 1), "mse")
    report, _ = lt.train_loader(runner, lt.LoaderTrainConfig(epochs=1, optimizer=lt.optim.sgd(1e-3), log_every=0),
                                loader, log=None)
    assert report.steps == 3


class _Sized(torch.utils.data.Dataset):
    def __init__(self, n, grow_after=None):
        self.n, self.grow_after, self.calls = n, grow_after, 0

    def __len__(self):
        self.calls += 1
        return 12 if self.grow_after is not None and self.calls > self.grow_after else self.n

    def __getitem__(self, i):
        return torch.full((3,), float(i)), torch.zeros(2)


@pytest.mark.parametrize("make", ["torch", "leantrain"])
@pytest.mark.parametrize("n", [2.5, -1, 10**20])
def test_a_dataset_length_that_is_not_a_count_is_a_data_error_before_anything_trains(make, n):
    r = lt.Runner.from_module(torch.nn.Linear(3, 2), "mse")
    before = [t.clone() for t in r.module.parameters()]
    with pytest.raises(lt.DataError, match=r"__len__\(\) returned .*: expected an integer >= 0"):
        loader = (torch.utils.data.DataLoader(_Sized(n), batch_size=4) if make == "torch"
                  else lt.DataLoader(_Sized(n), batch_size=4))
        lt.train_loader(r, lt.LoaderTrainConfig(epochs=2, log_every=0), loader)
    assert all(torch.equal(a, b) for a, b in zip(before, r.module.parameters()))


@pytest.mark.parametrize("make", ["torch", "leantrain"])
def test_a_dataset_whose_length_changes_between_epochs_is_a_data_error(make):
    ds = _Sized(8, grow_after=6)
    loader = (torch.utils.data.DataLoader(ds, batch_size=4) if make == "torch"
              else lt.DataLoader(ds, batch_size=4, shuffle=True))
    r = lt.Runner.from_module(torch.nn.Linear(3, 2), "mse")
    with pytest.raises(lt.DataError, match="the dataset's length changed from 8 to 12"):
        lt.train_loader(r, lt.LoaderTrainConfig(epochs=6, log_every=0, measure_loss=False), loader)
