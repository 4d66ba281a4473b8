"""Every container a sample may hold reaches the model as the user built it (torch's
pytrees walk them: #57): a namedtuple, an OrderedDict, a list, a registered dataclass
inside ``x``, and a top-level namedtuple ``x`` (unpacked as ``model(*x)``, as a tuple
is), through training, ``evaluate`` and ``predict``, on the CPU device and a device
placement (``to_device``), row cutting (``split_rows``) included."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import leantrain as lt
from leantrain import optim
from leantrain.samples import split_rows, to_device

P = namedtuple("P", "a b")


@dataclasses.dataclass
class Pair:
    a: torch.Tensor
    b: torch.Tensor


pytree.register_dataclass(Pair) if hasattr(pytree, "register_dataclass") else None

KINDS = {
    "namedtuple": (lambda a, b: {"p": P(a, b)}, lambda p: (p.a, p.b), P),
    "OrderedDict": (lambda a, b: {"p": OrderedDict(a=a, b=b)}, lambda p: (p["a"], p["b"]), OrderedDict),
    "list": (lambda a, b: {"p": [a, b]}, lambda p: (p[0], p[1]), list),
    "tuple": (lambda a, b: {"p": (a, b)}, lambda p: (p[0], p[1]), tuple),
    "dataclass": (lambda a, b: {"p": Pair(a, b)}, lambda p: (p.a, p.b), Pair),
}


class Reads(nn.Module):
    """Reads ``p`` as its container (``p.a`` on a namedtuple) and records the type it got."""

    def __init__(self, read):
        super().__init__()
        self.lin, self.read, self.seen = nn.Linear(3, 1), read, []

    def forward(self, p):
        self.seen.append(type(p))
        a, b = self.read(p)
        return self.lin(a) + b


def _data(make, n=4):
    g = torch.Generator().manual_seed(0)
    return [(make(torch.randn(2, 3, generator=g), torch.randn(2, 1, generator=g)), torch.randn(2, 1, generator=g))
            for _ in range(n)]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_container_inside_x_reaches_the_model_as_built(kind):
    make, read, cls = KINDS[kind]
    model = Reads(read)
    runner = lt.Runner.from_module(model, "mse")
    data = _data(make)
    lt.train_samples(runner, lt.TrainConfig(steps=2, batch_size=2, optimizer=optim.sgd(0.1), log_every=0), data,
                     log=None)
    lt.evaluate(runner, data)
    outs = lt.predict(runner, data, collect=True)
    assert len(outs) == 4 and model.seen and set(model.seen) == {cls}
    moved = to_device(data[0][0], torch.device("cpu"))
    assert type(moved["p"]) is cls
    pieces = split_rows(data[0], 2)
    assert len(pieces) == 2 and type(pieces[0][0]["p"]) is cls and read(pieces[1][0]["p"])[0].shape == (1, 3)


def test_a_top_level_namedtuple_x_is_unpacked_as_a_tuple_is():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1)

        def forward(self, a, b):
            return self.lin(a) + b

    runner = lt.Runner.from_module(Two(), "mse")
    data = _data(lambda a, b: P(a, b))
    lt.train_samples(runner, lt.TrainConfig(steps=1, batch_size=2, optimizer=optim.sgd(0.1), log_every=0), data,
                     log=None)
    assert lt.evaluate(runner, data)["items"] == 4


def test_predict_detaches_namedtuple_outputs():
    """A model returning a namedtuple: ``predict`` gives the namedtuple, its tensors detached."""
    class Out(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1)

        def forward(self, x):
            y = self.lin(x)
            return P(y, y * 2)

    runner = lt.Runner.from_module(Out(), lambda out, y: ((out.a - y) ** 2).mean())
    outs = lt.predict(runner, [(torch.randn(2, 3), torch.randn(2, 1))], collect=True)
    assert type(outs[0]) is P and not outs[0].a.requires_grad and outs[0].b.grad_fn is None
