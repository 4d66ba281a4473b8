"""One reading of a loader's batch for every pass (#54 item 1): each collate kind users bring
(torch's ``default_collate`` on pairs and on dicts, a tuple, a Hugging Face collator's
``BatchEncoding``, a list of samples) through leantrain's and torch's loaders, in training
(with the before/after passes), ``evaluate``, ``predict`` and ``find_lr``, against the
plain loop; a batch of another kind is a ``DataError`` naming it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import default_collate

import leantrain as lt
from leantrain import optim

transformers = pytest.importorskip("transformers")


def _stack(batch):
    return torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])


# kind -> (items are dicts, collate)
KINDS = {
    "default_collate-pairs": (False, default_collate),
    "default_collate-dicts": (True, default_collate),
    "tuple": (False, lambda b: tuple(_stack(b))),
    "BatchEncoding": (True, lambda b: transformers.BatchEncoding(default_collate(b))),
    "hf-default_data_collator": (True, lambda b: transformers.default_data_collator(b)),
    "list-of-samples": (False, lambda b: list(b)),
}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, x, y=None):
        return self.lin(x)


def _items(dicts: bool):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(12):
        x, y = torch.randn(3, generator=g), torch.randn(1, generator=g)
        out.append({"x": x, "y": y} if dicts else (x, y))
    return out


def _loss(dicts: bool):
    if dicts:
        return lambda out, s: torch.nn.functional.mse_loss(out, s["y"])
    return "mse"


def _loader(kind: str, which: str):
    dicts, collate = KINDS[kind]
    if which == "leantrain":
        return lt.DataLoader(_items(dicts), batch_size=4, collate=collate)
    return torch.utils.data.DataLoader(_items(dicts), batch_size=4, collate_fn=collate)


def _plain_batches(kind: str):
    dicts = KINDS[kind][0]
    items = _items(dicts)
    for k in range(0, 12, 4):
        b = items[k:k + 4]
        if kind == "list-of-samples":  # a list batch: each sample its own forward, the mean of their losses
            yield [(s[0], s[1]) for s in b]
        elif dicts:
            yield [(torch.stack([s["x"] for s in b]), torch.stack([s["y"] for s in b]))]
        else:
            yield [_stack(b)]


@pytest.mark.parametrize("which", ["leantrain", "torch"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_pass_reads_a_collated_batch_as_training_does(kind, which):
    dicts = KINDS[kind][0]
    model = Net()
    ref = copy.deepcopy(model)
    runner = lt.Runner.from_module(model, _loss(dicts))
    report, _ = lt.train_loader(runner, lt.LoaderTrainConfig(epochs=1, optimizer=optim.sgd(0.1), log_every=0,
                                                   measure_batches=None),
                                _loader(kind, which), log=None)
    # the plain loop: the batch's mean loss (a list batch: the mean of its samples' losses)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, fused=True)
    for batch in _plain_batches(kind):
        total = None
        for x, y in batch:
            loss = torch.nn.functional.mse_loss(ref(x), y)
            total = loss if total is None else total + loss
        opt.zero_grad()
        (total * (1.0 / len(batch))).backward()
        opt.step()
    if kind == "list-of-samples":  # leantrain folds the items' gradients, then 1/n (exactness.md): to rounding
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        ref.load_state_dict(model.state_dict())
    else:
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    # evaluation and predict read the same batches: the plain loop's mean and outputs
    losses, outs = [], []
    with torch.no_grad():
        for batch in _plain_batches(kind):
            for x, y in batch:
                losses.append(torch.nn.functional.mse_loss(ref(x), y))
                outs.append(ref(x))
    total = losses[0]
    for v in losses[1:]:
        total = total + v
    results = lt.evaluate(runner, _loader(kind, which))
    assert results["items"] == len(losses) and results["loss"] == float((total * (1.0 / len(losses))).item())
    predicted = lt.predict(runner, _loader(kind, which), collect=True)
    assert len(predicted) == len(outs) and all(torch.equal(a, b) for a, b in zip(predicted, outs))
    assert report.before is not None and report.after == pytest.approx(results["loss"], rel=1e-6)  # whole passes
    state = copy.deepcopy(model.state_dict())
    found = lt.find_lr(runner, _loader(kind, which), optim.sgd(0.1), steps=4, diverge=1e9)
    assert len(found.lrs) == 4 and all(torch.equal(a, b) for a, b in zip(state.values(), model.state_dict().values()))


@pytest.mark.parametrize("which", ["leantrain", "torch"])
def test_a_batch_of_another_kind_is_a_data_error_naming_it(which):
    class Batch:
        def __init__(self, b):
            self.x, self.y = _stack(b)

    items = _items(False)
    loader = (lt.DataLoader(items, batch_size=4, collate=Batch) if which == "leantrain"
              else torch.utils.data.DataLoader(items, batch_size=4, collate_fn=Batch))
    runner = lt.Runner.from_module(Net(), "mse")
    for call in (lambda: lt.evaluate(runner, loader), lambda: lt.predict(runner, loader, collect=True),
                 lambda: lt.train_loader(runner, lt.LoaderTrainConfig(epochs=1, optimizer=optim.sgd(0.1),
                                                                      log_every=0), loader, log=None)):
        with pytest.raises(lt.DataError, match="got Batch"):
            call()
