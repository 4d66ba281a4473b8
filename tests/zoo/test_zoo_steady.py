"""A loop checks once what cannot change within it, and again after the user's code runs.

``Runner.steady`` (see runner.py): the slot map, the module binding and the optimizer's
layout are built at a loop's first step and reused until a callback, a log line, an
evaluation or a checkpoint ran. These tests pin down both halves: reuse (the work is
done once) and the recheck (a change made by a callback is honoured or refused at the
next step, exactly as between two calls). Also: the direct autograd engine call gives
``torch.autograd.grad``'s bits.
"""

import dataclasses

import pytest
import torch
from torch import nn

import leantrain as lt
from leantrain import optim
from leantrain.training.runner import backward
from zoo_models import ZOO, BY_NAME


def bits(t):
    return t.detach().reshape(-1).view(torch.uint8).clone()


@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
def test_the_engine_call_gives_autograd_grads_bits(entry):
    model = entry.model()
    wrt = tuple(p for p in model.parameters() if p.requires_grad)
    x, y = entry.samples(1)[0]
    loss_fn = entry.loss_fn()
    got = []
    for public in (False, True):
        torch.manual_seed(5)  # the same dropout draw on both passes
        loss = loss_fn(model(x), y)
        got.append(backward.gradients(loss, wrt, backward.all_plain(wrt), force_public=public))
    for a, b in zip(*got):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(bits(a), bits(b))


def test_a_tensor_subclass_goes_through_autograd_grad(monkeypatch):
    class Tagged(torch.Tensor):
        pass

    p = nn.Parameter(torch.ones(3))
    tagged = torch.ones(3).as_subclass(Tagged).requires_grad_(True)
    assert backward.all_plain((p, torch.ones(2, requires_grad=True)))
    assert not backward.all_plain((p, tagged))
    public = []
    real = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: public.append(1) or real(*a, **k))
    wrt = (p,)
    backward.gradients((p * 2).sum(), wrt, backward.all_plain(wrt))
    assert public == []  # plain tensors on the CPU: the engine directly
    wrt = (p, tagged)
    g = backward.gradients((p * tagged).sum(), wrt, backward.all_plain(wrt))
    assert public and torch.equal(g[0], torch.ones(3))  # a subclass: torch.autograd.grad (it may re-enter)


@pytest.mark.parametrize("hooks", ["none", "step_callback", "log_lines"])
def test_a_loop_checks_once_unless_user_code_runs(hooks):
    entry = BY_NAME["gpt"]  # a tie: the layout sums two occurrences each step
    r = lt.Runner.from_module(entry.model(), entry.loss)
    steps = 8
    cfg = lt.TrainConfig(steps=steps, optimizer=optim.adam(1e-2), log_every=2 if hooks == "log_lines" else 0,
                         measure_loss=False)
    before = dataclasses.replace(r.stats)
    lt.train_samples(r, cfg, entry.samples(4), log=lambda s: None,
                     callback=(lambda ev: None) if hooks == "step_callback" else None)
    # "none": built at the first step only; a callback rechecks after every step; a log
    # line every 2 steps rechecks after steps 0, 2, 4, 6 (so steps 1, 3, 5, 7 rebuild).
    want = {"none": 1, "step_callback": steps, "log_lines": 1 + steps // 2}[hooks]
    assert r.stats.layouts - before.layouts == want
    assert r.stats.bindings - before.bindings >= want  # the tied model's binding swaps leaves in: never reused


def test_the_binding_without_swaps_is_reused():
    entry = BY_NAME["lstm"]
    r = lt.Runner.from_module(entry.model(), entry.loss)
    cfg = lt.TrainConfig(steps=6, optimizer=optim.sgd(0.1), log_every=0, measure_loss=False)
    lt.train_samples(r, cfg, entry.samples(3), log=lambda s: None)
    assert (r.stats.layouts, r.stats.bindings) == (1, 1)


def test_outside_a_loop_every_step_checks_everything():
    entry = BY_NAME["lstm"]
    r = lt.Runner.from_module(entry.model(), entry.loss)
    opt = optim.sgd(0.1)
    state = opt.init(r.params)
    for _ in range(3):
        state = lt.step_batch(r, opt, state, False, entry.samples(2))
    assert (r.stats.layouts, r.stats.bindings) == (3, 3)


@pytest.mark.parametrize("name", ["gpt", "cnn_batchnorm", "frozen_backbone"])
def test_a_slot_frozen_by_a_callback_mid_loop_is_honoured_at_the_next_step(name):
    entry = BY_NAME[name]
    samples = entry.samples(3)
    freeze = 1  # the second trainable slot that is not tied

    def cfg(steps):
        return lt.TrainConfig(steps=steps, batch_size=1, optimizer=optim.sgd(0.05), log_every=0, measure_loss=False)

    # One run whose callback freezes the slot after update 3 ...
    a = lt.Runner.from_module(entry.model(), entry.loss)
    ids = [id(v.storage) for v in a.params]
    untied = [i for i, c in enumerate(a.params.canonical_slot_indices()) if c == i and ids.count(ids[i]) == 1]
    freeze = untied[freeze]

    def cb(ev):
        if ev.step == 3:
            a.params[freeze].requires_grad = False

    lt.train_samples(a, cfg(6), samples, log=lambda s: None, callback=cb)
    # ... equals two runs with the slot frozen between them (SGD keeps no history).
    b = lt.Runner.from_module(entry.model(), entry.loss)
    lt.train_samples(b, cfg(3), samples, log=lambda s: None)
    frozen_value = b.params[freeze].value().clone()
    b.params[freeze].requires_grad = False
    lt.train_samples(b, cfg(3), samples, log=lambda s: None)
    assert torch.equal(a.params[freeze].value(), frozen_value)
    for i, (va, vb) in enumerate(zip(a.params.values(), b.params.values())):
        assert torch.equal(bits(va), bits(vb)), a.params.label(i)


def test_a_parameter_replaced_by_a_callback_is_refused_at_the_next_step():
    entry = BY_NAME["cnn_batchnorm"]
    model = entry.model()
    r = lt.Runner.from_module(model, entry.loss)
    seen = []

    def cb(ev):
        seen.append(ev.step)
        if ev.step == 2:
            model.head.weight = nn.Parameter(torch.zeros_like(model.head.weight))

    cfg = lt.TrainConfig(steps=5, optimizer=optim.sgd(0.1), log_every=0, measure_loss=False)
    with pytest.raises(lt.ConfigError, match=r"slot 3 \('head.weight'\): the module's parameter was replaced"):
        lt.train_samples(r, cfg, entry.samples(2), log=lambda s: None, callback=cb)
    assert seen == [1, 2]  # refused at the third update, before it changed anything


def test_a_read_only_callback_does_not_recheck():
    entry = BY_NAME["lstm"]
    r = lt.Runner.from_module(entry.model(), entry.loss)
    cfg = lt.TrainConfig(steps=5, optimizer=optim.sgd(0.1), log_every=0, measure_loss=False)

    class Reader(lt.Callback):
        reads_only = True

        def __init__(self):
            self.steps = []

        def on_step(self, event):
            self.steps.append(event.step)

    reader = Reader()
    lt.train_samples(r, cfg, entry.samples(3), log=lambda s: None, callbacks=[reader])
    assert reader.steps == [1, 2, 3, 4, 5] and r.stats.layouts == 1
