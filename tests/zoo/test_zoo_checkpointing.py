"""Activation checkpointing in both of torch's modes trains, with the bits of a plain
``loss.backward()`` loop: ``use_reentrant=False`` runs through ``autograd.grad`` as
everything else; ``use_reentrant=True`` (transformers' option, and the old default of
``torch.utils.checkpoint``) cannot, so the update falls back to a backward into the
step's leaves, leaving the user's ``.grad`` as it was."""

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import leantrain as lt
from hf_models import bert, cls_samples, model_loss
from oracle import assert_same_state


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.pre, self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 1)

    def block(self, h):
        return torch.tanh(self.b(torch.tanh(self.a(h))))

    def forward(self, x):
        # the segment's input requires a gradient (reentrant checkpointing gives its
        # parameters none otherwise, in plain PyTorch too)
        return self.c(checkpoint(self.block, self.pre(x), use_reentrant=self.reentrant))


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpointed_module_trains_as_the_plain_loop(reentrant):
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    ref = copy.deepcopy(model)
    data = [(torch.randn(6, generator=torch.Generator().manual_seed(k)), torch.randn(1)) for k in range(4)]
    r = lt.Runner.from_module(model, "mse")
    lt.train_samples(r, lt.TrainConfig(steps=4, batch_size=1, optimizer=lt.optim.adamw(0.01)), data, log=None)
    theirs = torch.optim.AdamW(ref.parameters(), lr=0.01, fused=True)
    for x, y in data:
        theirs.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ref(x), y).backward()
        theirs.step()
    assert_same_state(model, ref, exact=True)
    assert all(p.grad is None for p in model.parameters())  # the user's .grad untouched


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("reentrant", [True, False])
def test_bert_with_gradient_checkpointing_trains_as_the_plain_loop(reentrant):
    model = bert()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    ref = copy.deepcopy(model)
    samples = cls_samples(3)
    r = lt.Runner.from_module(model, "model")
    report = lt.train_samples(r, lt.TrainConfig(steps=3, optimizer=lt.optim.adamw(1e-3), log_every=1,
                                                measure_loss=False), samples, log=None)
    theirs = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    losses = []
    for s in samples:
        theirs.zero_grad(set_to_none=True)
        loss = model_loss(ref, s)
        loss.backward()
        losses.append(loss.item())
        theirs.step()
    assert_same_state(model, ref, exact=True)
    assert [v for _, v in report.losses] == losses
