"""Training on every zoo model against a hand-written torch.optim loop on a deep copy."""

import copy

import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader, TensorDataset

import leantrain as lt
from oracle import OPTIMIZERS, assert_same_state, module_fingerprint, plain_loop, run_both
from zoo_models import ZOO


def _cfg(opt, **kw):
    return lt.TrainConfig(optimizer=opt, log_every=0, **kw)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
def test_single_item_steps_equal_the_plain_loop(entry, opt_name):
    """Batches of one item: leantrain is the loop every user writes, bit for bit where
    leantrain's rule equals torch.optim's (Adam/AdamW: to rounding)."""
    exact = OPTIMIZERS[opt_name][3]
    both = run_both(entry, opt_name, lt.TrainConfig(steps=3, batch_size=1, log_every=0), n=3, seed=11,
                    reference=lambda ref, batches: plain_loop(ref, entry.loss_fn(), [b[0] for b in batches], opt_name))
    assert_same_state(both.model, both.ref, exact=exact and not entry.tied, rtol=1e-5)


@pytest.mark.parametrize("mirror", [False, True], ids=["host", "mirror"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
def test_accumulated_steps_equal_the_reference(entry, opt_name, mirror):
    """Batches of two items (gradient accumulation), on the host and native paths."""
    both = run_both(entry, opt_name, lt.TrainConfig(steps=4, batch_size=2, log_every=0), mirror=mirror)
    assert_same_state(both.model, both.ref, exact=False, rtol=2e-5)


@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
def test_train_loader_over_a_shuffled_torch_dataloader_equals_the_hand_loop(entry):
    """The measuring passes (before/after, counting items) must not draw from the
    loader's generator: the epochs see exactly the user's own orders."""
    model = entry.model()
    ref = copy.deepcopy(model)
    xs, ys = zip(*entry.samples(12, rows=1))
    data = TensorDataset(torch.cat(xs), torch.cat(ys))

    def loader():
        return TorchLoader(data, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(3))

    ours, theirs = loader(), loader()
    torch.manual_seed(9)
    cfg = lt.LoaderTrainConfig(epochs=3, optimizer=lt.optim.sgd(0.1), log_every=0)
    report, _ = lt.train_loader(lt.Runner.from_module(model, entry.loss), cfg, ours)
    torch.manual_seed(9)
    plain_loop(ref, entry.loss_fn(), [b for _ in range(3) for b in theirs], "sgd")
    assert report.steps == 12
    assert_same_state(model, ref, exact=not entry.tied, rtol=1e-6)
    assert torch.equal(ours.generator.get_state(), theirs.generator.get_state())


@pytest.mark.parametrize("loop", ["samples", "loader", "native"])
@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
def test_the_module_is_intact_after_a_loop(entry, loop):
    model = entry.model()
    before = module_fingerprint(model)
    objects = [p for _, p in model.named_parameters(remove_duplicate=False)]
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    r = lt.Runner.from_module(model, entry.loss)
    samples = entry.samples(4)
    if loop == "loader":
        cfg = lt.LoaderTrainConfig(epochs=2, optimizer=lt.optim.adam(0.01), log_every=0)
        lt.train_loader(r, cfg, lt.DataLoader(lt.Dataset(samples), batch_size=2, shuffle=True, seed=1))
    else:
        if loop == "native":
            r.to("cpu")  # a CPU mirror: the native path writes mirrors only
        lt.train_samples(r, _cfg(lt.optim.adam(0.01), steps=3, batch_size=2), samples)
    assert module_fingerprint(model) == before
    assert all(p is q for p, q in zip(objects, (p for _, p in model.named_parameters(remove_duplicate=False))))
    if entry.tied:
        assert model.lm_head.weight is model.tok_emb.weight
    # the trained values are what the module holds (and they did change)
    values = r.params.values_synced()
    state = model.state_dict()
    for v, name in zip(values, r.params.names):
        assert torch.equal(state[name], v), name
    changed = [k for k, v in state.items() if not torch.equal(v, initial[k])]
    assert any(k in dict(model.named_parameters()) for k in changed)
