"""A torch DataLoader over a TensorDataset is read without its per-item loop: the same
index lists (its own iterator draws them), the same bits, the same random draws after."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import leantrain as lt
from leantrain.training.loops.batches import fast_batches


def tensors(n=23):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, 2, generator=g), torch.randint(0, 5, (n,), generator=g)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", ["no", "global", "generator"])
@pytest.mark.parametrize("batch_size", [1, 4, 23, 50])
def test_the_same_batches_and_the_same_draws(shuffle, drop_last, batch_size):
    x, y = tensors()

    def make():
        gen = torch.Generator().manual_seed(5) if shuffle == "generator" else None
        return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle != "no", drop_last=drop_last,
                          generator=gen), gen

    for epoch in range(2):
        torch.manual_seed(epoch)
        a, ga = make()
        plain = list(a)
        after = torch.get_rng_state(), None if ga is None else ga.get_state()
        torch.manual_seed(epoch)
        b, gb = make()
        fast = fast_batches(b)
        assert fast is not None
        fast = list(fast)
        assert torch.equal(torch.get_rng_state(), after[0])
        assert gb is None or torch.equal(gb.get_state(), after[1])
        assert len(plain) == len(fast)
        for (px, py), (fx, fy) in zip(plain, fast):
            assert px.dtype == fx.dtype and px.shape == fx.shape and torch.equal(px, fx) and torch.equal(py, fy)


def test_other_loaders_go_through_the_loader():
    x, y = tensors()
    ds = TensorDataset(x, y)
    assert fast_batches(DataLoader(ds, batch_size=4, num_workers=1)) is None
    assert fast_batches(DataLoader(ds, batch_size=4, collate_fn=lambda b: b)) is None
    assert fast_batches(DataLoader(TensorDataset(x, y, y), batch_size=4)) is None
    assert fast_batches(DataLoader(ds, batch_size=None)) is None
    assert fast_batches([(x, y)]) is None


def test_train_loader_gives_the_bits_of_the_dataloader_itself():
    x, y = tensors(32)
    x = x.reshape(32, 6)
    y = y.float().reshape(32, 1)

    def run(fast):
        torch.manual_seed(0)
        r = lt.Runner.from_module(torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)), "mse")
        loader = DataLoader(TensorDataset(x, y), batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(1))
        if not fast:  # the same loader, but not recognisable as a plain one: goes through the per-item loop
            loader = iter_twice(loader)
        report, _ = lt.train_loader(r, lt.LoaderTrainConfig(epochs=3, log_every=1), loader, log=lambda s: None)
        return report, r.params.values()

    (ra, pa), (rb, pb) = run(True), run(False)
    assert ra.losses == rb.losses and all(torch.equal(a, b) for a, b in zip(pa, pb))


class iter_twice:
    """A DataLoader behind a wrapper: its generators visible (so measuring passes leave
    them be), its type not a plain DataLoader."""

    def __init__(self, loader):
        self.loader = loader
        self.generator, self.sampler, self.batch_sampler = loader.generator, loader.sampler, loader.batch_sampler

    def __iter__(self):
        return iter(self.loader)

    def __len__(self):
        return len(self.loader)


@pytest.mark.parametrize("measure", [False, True])
def test_the_loader_is_read_once_per_epoch_unless_losses_are_measured(measure):
    x, y = tensors(12)

    class Counting(torch.utils.data.SequentialSampler):
        passes = 0

        def __iter__(self):
            Counting.passes += 1
            return super().__iter__()

    ds = TensorDataset(x.reshape(12, 6), y.float().reshape(12, 1))
    loader = DataLoader(ds, batch_size=5, sampler=Counting(ds), drop_last=True)
    runner = lt.Runner.from_module(torch.nn.Linear(6, 1), "mse")
    cfg = lt.LoaderTrainConfig(epochs=2, optimizer=lt.optim.sgd(0.1), log_every=0, measure_loss=measure)
    report, _ = lt.train_loader(runner, cfg, loader, log=lambda s: None)
    # two epochs; the before/after losses read one pass each, only when measured
    assert Counting.passes == (4 if measure else 2)
    assert report.steps == 4 and report.samples_seen == 4  # 2 batches (drop_last) per epoch: 2 items each
