"""#70: ``lt.DataLoader`` over single rows without a collate trains each row as its own item
(a forward and a backward each); ``train_loader`` says so once, at the point of use, naming
``collate=lt.collate.stack`` (one minibatch item) and ``collate=lt.collate.items`` (a row
per item, on purpose: silent). Items that are minibatches already, a batch of one and a
dataset read by index are not hinted at (nothing is read for the hint)."""

import warnings

import pytest
import torch

import leantrain as lt


def rows(n=32):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, generator=g), torch.randn(1, generator=g)) for _ in range(n)]


def train(loader):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    cfg = lt.LoaderTrainConfig(epochs=1, optimizer=lt.optim.sgd(0.1), log_every=0)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        report, _ = lt.train_loader(lt.Runner.from_module(model, "mse"), cfg, loader)
    return model, report, [str(w.message) for w in said], [w.filename for w in said]


def test_single_rows_without_a_collate_are_said_once_at_the_call():
    _, report, said, where = train(lt.DataLoader(rows(), batch_size=8))
    assert len(said) == 1 and where == [__file__]  # the user's line
    assert "single rows (the first's input shaped (4,))" in said[0]
    assert "8 per update" in said[0]
    assert "collate=leantrain.collate.stack" in said[0] and "collate=leantrain.collate.items" in said[0]
    assert report.samples_seen == 32 and report.steps == 4  # trained as before: a row per item


def test_saying_what_you_mean_is_silent_and_trains_as_said():
    quiet_model, quiet, said, _ = train(lt.DataLoader(rows(), batch_size=8, collate=lt.collate.items))
    hinted_model, _, _, _ = train(lt.DataLoader(rows(), batch_size=8))
    assert said == []
    assert all(torch.equal(a, b) for a, b in zip(quiet_model.parameters(), hinted_model.parameters()))
    model, stacked, said, _ = train(lt.DataLoader(rows(), batch_size=8, collate=lt.collate.stack))
    assert said == [] and stacked.steps == 4 and stacked.samples_seen == 4  # one minibatch item per update


@pytest.mark.parametrize("loader", [
    lambda: lt.DataLoader([(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(4)], batch_size=2),  # minibatches
    lambda: lt.DataLoader(rows(), batch_size=1),  # one item per update: nothing to stack
    lambda: lt.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4),
])
def test_nothing_is_said_where_rows_are_not_the_case_or_not_read(loader):
    assert train(loader())[2] == []


def test_stack_refuses_rows_of_different_shapes():
    with pytest.raises(lt.DataError, match="stack: the rows cannot be stacked"):
        lt.collate.stack([(torch.randn(3), torch.randn(1)), (torch.randn(4), torch.randn(1))])
    assert tuple(lt.collate.stack([{"x": torch.randn(3)}, {"x": torch.randn(3)}])["x"].shape) == (2, 3)
