"""Gradient clipping on every zoo model against ``torch.nn.utils.clip_grad_norm_`` /
``clip_grad_value_`` + ``torch.optim`` on a deep copy: bit for bit with SGD on models
without ties (the same kernels in the same order), to rounding with a tie (autograd sums
the two occurrences in its own order; leantrain sums them left to right), and the norm
before clipping reported on logged steps."""

import copy

import pytest
import torch

import leantrain as lt
from leantrain import optim
from optimizer_table import TABLE
from oracle import OPTIMIZERS, assert_same_state, reference_gradients, run_both
from zoo_models import ZOO


def reference(model, entry, batches, opt_name, clip):
    _, cls, kwargs, _ = OPTIMIZERS[opt_name]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = cls(params, **kwargs)
    norms = []
    for batch in batches:
        reference_gradients(model, entry.loss_fn(), batch)
        if "norm" in clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip["norm"])))
        else:
            torch.nn.utils.clip_grad_value_(params, clip["value"])
        opt.step()
    return norms


CLIPS = {"norm": {"norm": 0.05}, "value": {"value": 0.01}}


@pytest.mark.parametrize("how", sorted(CLIPS))
@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
def test_clipping_equals_torch(entry, how):
    clip = CLIPS[how]
    norms = []
    cfg = lt.TrainConfig(steps=4, batch_size=2, log_every=1, clip_grad_norm=clip.get("norm"),
                         clip_grad_value=clip.get("value"))
    both = run_both(entry, optim.sgd(0.1), cfg,
                    reference=lambda ref, batches: norms.extend(reference(ref, entry, batches, "sgd", clip)))
    report = both.report
    assert_same_state(both.model, both.ref, exact=not entry.tied, rtol=1e-5)
    if how == "norm":
        assert [s for s, _ in report.grad_norms] == [1, 2, 3, 4]  # updates numbered from 1
        got = [n for _, n in report.grad_norms]
        if entry.tied:
            assert got == pytest.approx(norms, rel=1e-5)
        else:
            assert got == norms
        assert max(norms) > clip["norm"]  # the clip was active
    else:
        assert report.grad_norms == ()


@pytest.mark.parametrize("mirror", [False, True], ids=["host", "mirror"])
@pytest.mark.parametrize("opt_name", [name for name, case in TABLE.items() if case.stateful])
@pytest.mark.parametrize("entry", [e for e in ZOO if e.name in ("gpt", "cnn_batchnorm", "frozen_backbone")],
                         ids=lambda e: e.name)
def test_clipping_with_stateful_optimizers_and_mirrors(entry, opt_name, mirror):
    cfg = lt.TrainConfig(steps=4, batch_size=2, log_every=0, clip_grad_norm=0.05)
    both = run_both(entry, opt_name, cfg, mirror=mirror,
                    reference=lambda ref, batches: reference(ref, entry, batches, opt_name, {"norm": 0.05}))
    assert_same_state(both.model, both.ref, exact=False, rtol=2e-5)


def test_a_tie_counts_once_with_its_summed_gradient():
    """The norm is over storages: a tied weight's summed gradient enters once (not each
    occurrence's part), and both occurrences move by the one clipped update."""
    entry = next(e for e in ZOO if e.name == "gpt")
    model = entry.model()
    runner = lt.Runner.from_module(model, entry.loss)
    batch = entry.samples(2)
    torch.manual_seed(3)  # the same dropout masks in both passes
    grads = lt.mean_gradients(runner, batch)
    reps = runner.params.canonical_slot_indices()
    sums = {}
    for i, c in enumerate(reps):
        if c is not None:
            sums[c] = grads[i].double() if c not in sums else sums[c] + grads[i].double()
    expected = torch.sqrt(sum((g * g).sum() for g in sums.values())).item()
    naive = torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None)).item()
    assert expected != pytest.approx(naive, rel=1e-3)  # the tie matters here
    cfg = lt.TrainConfig(steps=1, batch_size=2, optimizer=optim.sgd(0.1), log_every=1, clip_grad_norm=1e-3)
    torch.manual_seed(3)
    report = lt.train_samples(runner, cfg, batch, log=lambda s: None)
    assert report.grad_norms[0][1] == pytest.approx(expected, rel=1e-5)
    assert model.lm_head.weight is model.tok_emb.weight


@pytest.mark.parametrize("kwargs, match", [
    (dict(clip_grad_norm=1.0, clip_grad_value=1.0), "choose one way to clip"),
    (dict(clip_grad_norm=0.0), "clip_grad_norm must be a finite number > 0"),
    (dict(clip_grad_norm=float("inf")), "clip_grad_norm must be"),
    (dict(clip_grad_value=-1.0), "clip_grad_value must be"),
    (dict(clip_grad_value="1"), "clip_grad_value must be"),
    (dict(clip_grad_norm=True), "clip_grad_norm must be"),
])
def test_bad_clip_settings(kwargs, match):
    with pytest.raises(lt.ConfigError, match=match):
        lt.TrainConfig(steps=1, **kwargs)
    with pytest.raises(lt.ConfigError, match=match):
        lt.LoaderTrainConfig(epochs=1, **kwargs)
    r = lt.Runner.from_module(torch.nn.Linear(2, 1), "mse")
    opt = optim.sgd(0.1)
    with pytest.raises(lt.ConfigError, match=match):
        lt.step_batch(r, opt, opt.init(r.params), False, [(torch.ones(2), torch.ones(1))], **kwargs)


def test_step_batch_clips_like_torch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    ref = copy.deepcopy(model)
    batch = [(torch.randn(3), torch.randn(2)) for _ in range(2)]  # two items: any summation order agrees
    r = lt.Runner.from_module(model, "mse")
    opt = optim.sgd(0.5)
    state = opt.init(r.params)
    for _ in range(2):
        state, _ = lt.step_batch_and_loss(r, opt, state, False, batch, clip_grad_norm=0.1)
    r.sync()
    topt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(2):
        reference_gradients(ref, torch.nn.functional.mse_loss, batch)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        topt.step()
    assert_same_state(model, ref, exact=True)


@pytest.mark.parametrize("entry", [e for e in ZOO if e.name in ("cnn_batchnorm", "lstm")], ids=lambda e: e.name)
def test_train_loader_clips_like_torch(entry):
    model = entry.model()
    ref = copy.deepcopy(model)
    samples = entry.samples(4)
    batches = [samples[0:2], samples[2:4]]
    cfg = lt.LoaderTrainConfig(epochs=2, optimizer=optim.sgd(0.1), log_every=1, clip_grad_norm=0.05)
    torch.manual_seed(5)
    report, _ = lt.train_loader(lt.Runner.from_module(model, entry.loss), cfg, batches, log=lambda s: None)
    torch.manual_seed(5)
    norms = reference(ref, entry, batches * 2, "sgd", {"norm": 0.05})
    assert_same_state(model, ref, exact=True)
    assert [n for _, n in report.grad_norms] == norms
