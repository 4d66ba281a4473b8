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
def test_a_loop_checks_once_while_user_code_changes_nothing(hooks):
    """The user's code between updates (a step callback, a log function) costs one
    comparison of the module and slots with what was checked, not the checks again."""
    entry = BY_NAME["gpt"]  # a tie: the layout sums two occurrences each step
    r = lt.Runner.from_module(entry.model(), entry.loss)
    steps = 8
    cfg = lt.TrainConfig(steps=steps, optimizer=optim.adam(1e-2), log_every=2 if hooks == "log_lines" else 0,
                         measure_loss=False)
    before = dataclasses.replace(r.stats)
    lt.train_samples(r, cfg, entry.samples(4), log=lambda s: None,
                     callback=(lambda ev: None) if hooks == "step_callback" else None)
    assert r.stats.layouts - before.layouts == 1  # built at the first step only
    assert r.stats.bindings - before.bindings >= steps  # the tied model's binding swaps leaves in: never reused


def test_user_code_that_moves_a_parameter_to_new_memory_is_checked_again():
    """A callback that gives a Parameter new memory of the same shape: the next update
    checks everything again (a second layout) and trains as if nothing happened; new
    memory of another shape is refused at the next update, naming the slot."""
    entry = BY_NAME["lstm"]
    cfg = lt.TrainConfig(steps=4, optimizer=optim.adam(0.1), log_every=0, measure_loss=False)
    plain = lt.Runner.from_module(entry.model(), entry.loss)
    lt.train_samples(plain, cfg, entry.samples(3), log=lambda s: None)
    model = entry.model()
    r = lt.Runner.from_module(model, entry.loss)
    p = model.lstm.weight_ih_l0

    def same_shape(ev):
        if ev.step == 2:
            p.data = p.data.clone()  # new memory, same values

    lt.train_samples(r, cfg, entry.samples(3), log=lambda s: None, callback=same_shape)
    assert r.stats.layouts == 2 and model.lstm.weight_ih_l0 is p
    for a, b in zip(r.params.values(), plain.params.values()):
        assert torch.equal(bits(a), bits(b))

    model = entry.model()
    r = lt.Runner.from_module(model, entry.loss)
    p, seen = model.lstm.weight_ih_l0, []

    def other_shape(ev):
        seen.append(ev.step)
        if ev.step == 2:
            p.data = torch.zeros(p.shape[0] + 1, *p.shape[1:])
            seen.append([t.clone() for t in r.params.values()])

    with pytest.raises(lt.OptimizerStateError, match=r"slot 0 \('lstm.weight_ih_l0'\): optimizer state 'm' does not fit"):
        lt.train_samples(r, cfg, entry.samples(3), log=lambda s: None, callback=other_shape)
    assert seen[0] == 1 and seen[1] == 2 and len(seen) == 3  # refused at the third update
    assert all(torch.equal(a, b) for a, b in zip(seen[2], r.params.values()))  # before it changed anything


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
