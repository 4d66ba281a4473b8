"""Non-finite losses and gradients: raise with nothing changed, or skip on the device."""

import copy

import pytest
import torch

import leantrain as lt
from leantrain import optim
from models import TiedNet, regression_batches
from optimizer_table import TABLE


def poisoned(n=6, bad=(2,)):
    data = regression_batches(n, 3)
    for i in bad:
        x, y = data[i]
        data[i] = (x, torch.full_like(y, float("nan")))
    return data


@pytest.mark.parametrize("mirrors", [False, True])
@pytest.mark.parametrize("kind", sorted(TABLE))
def test_raise_names_the_step_and_changes_nothing(kind, mirrors, unchanged):
    torch.manual_seed(0)
    r = lt.Runner.from_module(TiedNet(bn=False), "mse")
    if mirrors:
        r.to("cpu")
    opt = TABLE[kind].make()
    state = opt.init(r.params, native=lt.training.loops.session.uses_native(r, opt))
    data = poisoned()
    state = lt.step_batch(r, opt, state, mirrors and opt.native, [data[0]])
    state = lt.step_batch(r, opt, state, mirrors and opt.native, [data[1]])
    with unchanged(r.params, state), pytest.raises(lt.NonFiniteError, match="NaN or infinite; nothing was updated"):
        lt.step_batch(r, opt, state, mirrors and opt.native, [data[2]])
    r2 = lt.Runner.from_module(TiedNet(bn=False), "mse")
    with pytest.raises(lt.NonFiniteError, match=r"^update 3: "):
        lt.train_samples(r2, lt.TrainConfig(steps=6, optimizer=opt, log_every=0), data)


@pytest.mark.parametrize("mirrors", [False, True])
def test_skip_leaves_the_step_out_and_counts_it(mirrors):
    """SGD is stateless: skipping the poisoned batches equals never seeing them."""
    torch.manual_seed(1)
    net = TiedNet(bn=False)
    a, b = lt.Runner.from_module(net, "mse"), lt.Runner.from_module(copy.deepcopy(net), "mse")
    if mirrors:
        a.to("cpu"), b.to("cpu")
    data = poisoned(6, bad=(1, 4))
    clean = [d for i, d in enumerate(data) if i not in (1, 4)]
    ra = lt.train_samples(a, lt.TrainConfig(steps=6, optimizer=optim.sgd(0.1), log_every=0, nonfinite="skip"), data)
    lt.train_samples(b, lt.TrainConfig(steps=4, optimizer=optim.sgd(0.1), log_every=0), clean)
    assert ra.skipped_steps == 2
    for x, y in zip(a.params.values_synced(), b.params.values_synced()):
        assert torch.equal(x, y)


@pytest.mark.parametrize("mirrors", [False, True])
def test_skip_restores_adam_tensors_on_the_device(mirrors):
    torch.manual_seed(2)
    r = lt.Runner.from_module(TiedNet(bn=False), "mse")
    if mirrors:
        r.to("cpu")
    opt = optim.adam(0.01)
    native = lt.training.loops.session.uses_native(r, opt)
    state = opt.init(r.params, native=native)
    data = poisoned()
    state = lt.step_batch(r, opt, state, native, [data[0]], nonfinite="skip")
    before = [t.clone() for t in r.params.values_synced()]
    moments = {i: [t.clone() for t in rec.tensors().values()] for i, rec in state.records().items()}
    skipped = torch.zeros(())
    state = lt.step_batch(r, opt, state, native, [data[2]], nonfinite="skip", skipped=skipped)
    assert skipped.item() == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, r.params.values_synced()))
    for i, rec in state.records().items():
        assert all(torch.equal(a, b) for a, b in zip(moments[i], rec.tensors().values()))
        assert rec.step == 2  # documented: the host-side counter still advances


def test_skip_reports_in_the_loader_loop():
    r = lt.Runner.from_module(TiedNet(bn=False), "mse")
    loader = lt.DataLoader(lt.Dataset(poisoned(6, bad=(0,))), batch_size=2)
    report, _ = lt.train_loader(r, lt.LoaderTrainConfig(epochs=2, optimizer=optim.sgd(0.1), log_every=0, nonfinite="skip"), loader)
    assert report.skipped_steps == 2  # the batch holding item 0, in each epoch
    assert all(torch.isfinite(v).all() for v in r.params.values())
