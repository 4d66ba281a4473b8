"""Gradual unfreezing: a ``requires_grad`` the user turns on (or off) on the module, from a
callback, is followed from the next update, as a plain PyTorch loop with ``torch.optim``
follows it (a fresh history where a parameter starts receiving gradients); checkpoints
carry the trainable set and a resume continues with it, bit for bit."""

import copy

import pytest
import torch
from torch import nn

import leantrain as lt
from hf_models import BY_NAME as HF, model_loss
from oracle import OPTIMIZERS, assert_same_state


def backbone_model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    for layer in (m[0], m[2]):
        for p in layer.parameters():
            p.requires_grad_(False)
    return m


def data(n=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(n)]


SCHEDULE = {3: [2], 5: [0]}  # after update 3 the middle layer trains, after 5 the first too


def unfreeze(model, step):
    for layer in SCHEDULE.get(step, []):
        for p in model[layer].parameters():
            p.requires_grad_(True)


class Unfreezer(lt.Callback):
    """The recipe as a callback (it changes the model: not reads_only)."""

    def __init__(self, model):
        self.model = model

    def on_step(self, event):
        unfreeze(self.model, event.step)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_unfreezing_mid_run_equals_the_plain_loop(opt_name):
    opt, cls, kwargs, _ = OPTIMIZERS[opt_name]
    model = backbone_model()
    ref = copy.deepcopy(model)
    r = lt.Runner.from_module(model, "mse")
    cfg = lt.TrainConfig(steps=8, optimizer=opt, log_every=0, measure_loss=False)
    lt.train_samples(r, cfg, data(), log=lambda s: None, callbacks=[Unfreezer(model)])
    if opt_name == "momentum":  # torch's fused SGD momentum fails on a parameter whose first gradient comes late
        kwargs = {k: v for k, v in kwargs.items() if k != "fused"}
    topt = cls(list(ref.parameters()), **kwargs)  # every parameter, frozen ones included
    for step, (x, y) in enumerate(data(), start=1):
        topt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ref(x), y).backward()
        topt.step()
        unfreeze(ref, step)
    assert_same_state(model, ref, exact=True)
    assert all(p.requires_grad for p in model.parameters())


def test_freezing_on_the_module_is_followed_too():
    model = backbone_model()
    unfreeze(model, 3), unfreeze(model, 5)
    r = lt.Runner.from_module(model, "mse")
    cfg = lt.TrainConfig(steps=4, optimizer=lt.optim.sgd(0.1), log_every=0, measure_loss=False)

    class Freezer(lt.Callback):
        def on_step(self, event):
            if event.step == 2:
                model[4].weight.requires_grad_(False)

    frozen_at = {}

    class Keep(lt.Callback):
        reads_only = True

        def on_step(self, event):
            if event.step == 2:
                frozen_at["w"] = model[4].weight.detach().clone()

    lt.train_samples(r, cfg, data(), log=lambda s: None, callbacks=[Freezer(), Keep()])
    assert torch.equal(model[4].weight, frozen_at["w"])  # no update after it was frozen
    assert not r.params[r.params.names.index("4.weight")].requires_grad


def test_a_resume_after_unfreezing_continues_with_the_trainable_set(tmp_path):
    """Interrupted after the first unfreezing, resumed on a fresh model frozen as at the
    start: the checkpoint's trainable set is taken (slots and the module's flags), the
    unfrozen slots' histories with it, and the run ends as the uninterrupted one."""
    def run(steps, path, resume=False):
        model = backbone_model()
        r = lt.Runner.from_module(model, "mse")
        cfg = lt.TrainConfig(steps=steps, optimizer=lt.optim.adam(1e-2), log_every=0, measure_loss=False,
                             checkpoint_path=path, resume_from=path if resume else None)
        lt.train_samples(r, cfg, data(), log=lambda s: None, callbacks=[Unfreezer(model)])
        return model

    straight = run(8, tmp_path / "a.ckpt")
    run(4, tmp_path / "b.ckpt")  # saved after update 4: the middle layer trainable, the first not yet
    manifest = lt.read_checkpoint(tmp_path / "b.ckpt")[0]
    assert [s["requires_grad"] for s in manifest["slots"]] == [False, False, True, True, True, True]
    assert sorted(manifest["optimizer"]["records"], key=int) == ["2", "3", "4", "5"]
    resumed = run(8, tmp_path / "b.ckpt", resume=True)
    assert_same_state(resumed, straight, exact=True)


def test_gradual_unfreezing_of_a_hugging_face_classifier():
    """BERT with its encoder frozen, the last layer unfrozen after update 2, as the
    fine-tuning recipe does, against the plain loop."""
    entry = HF["bert"]
    model = entry.model()
    for p in model.bert.parameters():
        p.requires_grad_(False)
    ref = copy.deepcopy(model)
    last = lambda m: m.bert.encoder.layer[-1].parameters()  # noqa: E731

    class Unfreeze(lt.Callback):
        def on_step(self, event):
            if event.step == 2:
                for p in last(model):
                    p.requires_grad_(True)

    samples = entry.samples(5)
    r = lt.Runner.from_module(model, "model")
    lt.train_samples(r, lt.TrainConfig(steps=5, optimizer=lt.optim.adamw(1e-3), log_every=0, measure_loss=False),
                     samples, log=lambda s: None, callbacks=[Unfreeze()])
    topt = torch.optim.AdamW(list(ref.parameters()), lr=1e-3, fused=True)
    for step, s in enumerate(samples, start=1):
        topt.zero_grad(set_to_none=True)
        model_loss(ref, s).backward()
        topt.step()
        if step == 2:
            for p in last(ref):
                p.requires_grad_(True)
    assert_same_state(model, ref, exact=True)
