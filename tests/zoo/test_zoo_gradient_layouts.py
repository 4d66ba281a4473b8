"""Gradients in any layout into ``opt.step``, expanded parameters, channels_last resume,
one gradient tensor for two slots (clipping, float16), sparse gradients."""

import copy

import pytest
import torch
from torch import nn

import leantrain as lt
from leantrain import optim
from leantrain.optim.records import MomentumState
from leantrain.optim.rules import record_type
from leantrain.params import ParamList
from leantrain.training.runner.backward import own_gradients
from layout_models import LAYOUT_BY_NAME, SPARSE
from leantrain.optim.records import parameter_shaped
from optimizer_table import TABLE
from oracle import OPTIMIZERS, assert_same_state, module_fingerprint

STATEFUL = [n for n in OPTIMIZERS if n != "sgd"]


def _torch_fused(opt_name, params):
    _, cls, kwargs, _ = OPTIMIZERS[opt_name]
    return cls(params, **kwargs)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_opt_step_reads_gradients_in_any_layout(opt_name):
    """A stride-0 gradient (autograd's for ``w.sum()``), a transposed gradient, and a
    transposed parameter with a contiguous gradient: each element is paired with its
    own, as torch.optim (whose ``.grad`` follows the parameter's layout) pairs them."""
    torch.manual_seed(0)
    w = torch.randn(4, 3)
    wt = torch.randn(3, 4).t()  # a transposed parameter: stride (1, 4)
    params = ParamList.of_pack([w, wt])
    assert params[1].storage.host.stride() == (1, 4)
    ours = OPTIMIZERS[opt_name][0]
    ref = [nn.Parameter(w.clone()), nn.Parameter(wt.clone())]
    theirs = _torch_fused(opt_name, ref)
    state = ours.init(params)
    for k in range(3):
        g0 = torch.randn(3).expand(4, 3) if k != 1 else torch.randn(3, 4).t()  # stride 0, transposed
        g1 = torch.randn(4, 3) * (k + 1)  # contiguous, for a transposed parameter
        state = ours.step(state, params, [g0, g1])
        ref[0].grad, ref[1].grad = g0.contiguous(), g1.t().contiguous().t()  # .grad in the parameter's layout
        theirs.step()
    exact = OPTIMIZERS[opt_name][3]
    for got, want in zip(params.values(), ref):
        assert torch.equal(got, want.detach()) if exact else torch.allclose(got, want.detach(), rtol=1e-6, atol=1e-7)


def test_none_gradient_in_opt_step_leaves_value_and_state():
    opt = optim.adamw(0.1, 0.5)
    params = ParamList.of_pack([torch.ones(3), torch.ones(2)])
    state = opt.step(opt.init(params), params, [torch.ones(3), None])
    assert torch.equal(params[1].storage.host, torch.ones(2))
    rec = state.slots[1]
    assert rec.step == 0 and torch.count_nonzero(rec.m) == 0 and torch.count_nonzero(rec.v) == 0
    assert state.slots[0].step == 1 and not torch.equal(params[0].storage.host, torch.ones(3))


def test_own_gradients_copies_shared_memory_only():
    a, b, c = (torch.zeros(3, requires_grad=True) for _ in range(3))
    g = torch.ones(3)
    h = torch.ones(3)
    out = own_gradients([g, g, h], [a, b, c])
    assert out[0] is g and out[2] is h  # the usual case: no copy
    assert out[1] is not g and out[1].data_ptr() != g.data_ptr() and torch.equal(out[1], g)
    x = torch.randn(4, 3, requires_grad=True)
    expanded = torch.ones(3).expand(4, 3)
    (got,) = own_gradients([expanded], [x])
    assert got.stride() == x.stride() and torch.equal(got, expanded)


class _Expanded(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.w = nn.Parameter(weight)


@pytest.mark.parametrize("make", [lambda: torch.zeros(3).expand(4, 3),
                                  lambda: torch.arange(6.0).as_strided((3, 3), (1, 1))],
                         ids=["expanded", "self_overlapping"])
def test_parameters_whose_elements_share_memory_are_refused(make):
    model = _Expanded(make())
    before = module_fingerprint(model)
    values = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(lt.AliasError, match=r"slot 0 \('w'\): a trainable tensor whose elements share memory"):
        lt.Runner.from_module(model, "mse")
    assert module_fingerprint(model) == before
    assert all(torch.equal(values[k], v) for k, v in model.state_dict().items())
    model.w.requires_grad_(False)  # frozen, it is never written: allowed
    lt.Runner.from_module(model, "mse")


@pytest.mark.parametrize("opt_name", STATEFUL)
def test_channels_last_and_transposed_resume_bit_for_bit(opt_name, tmp_path):
    """State is made and restored in the parameter's own layout, so a resumed run pairs
    the same elements as the uninterrupted one."""
    entry = LAYOUT_BY_NAME["transposed_channels_last"]
    opt = OPTIMIZERS[opt_name][0]
    samples = entry.samples(4)

    def steps(r, state, batch):
        for s in batch:
            state = lt.step_batch(r, opt, state, False, [s])
        return state

    straight = entry.model()
    r = lt.Runner.from_module(straight, entry.loss)
    steps(r, opt.init(r.params), samples)

    first = entry.model()
    r1 = lt.Runner.from_module(first, entry.loss)
    state = steps(r1, opt.init(r1.params), samples[:2])
    lt.save_checkpoint(tmp_path / "a.ckpt", r1, state=state, rng=False)
    resumed = entry.model(seed=5)
    r2 = lt.Runner.from_module(resumed, entry.loss)
    ck = lt.load_checkpoint(tmp_path / "a.ckpt", r2, optimizer=opt)
    for i, rec in ck.state.records().items():
        for k, t in rec.tensors().items():
            if parameter_shaped(type(rec), k):  # not Adafactor's row and column factors
                assert t.stride() == r2.params[i].storage.host.stride(), r2.params.label(i)
    steps(r2, ck.state, samples[2:])
    assert resumed.kernel.is_contiguous(memory_format=torch.channels_last) and resumed.wt.stride() == (1, 4)
    assert_same_state(resumed, straight, exact=True)


def _shared_reference(model, samples, clip=None, scaler=None, lr=0.1) -> int:
    """The plain loop (with clip_grad_norm_, or a GradScaler); returns the skipped steps."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, fused=True)
    skips = 0
    for x, y in samples:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
            loss = torch.nn.functional.mse_loss(model(x), y)
        if scaler is None:
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
        else:
            scaler.scale(loss).backward()
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skips += scaler.get_scale() < scale
    return skips


def test_one_gradient_for_two_slots_is_clipped_once():
    entry = LAYOUT_BY_NAME["shared_gradient"]
    model = entry.model()
    ref = copy.deepcopy(model)
    samples = entry.samples(4)
    lt.train_samples(lt.Runner.from_module(model, "mse"),
                     lt.TrainConfig(steps=4, batch_size=1, optimizer=optim.sgd(0.1), log_every=0, clip_grad_norm=0.05),
                     samples)
    _shared_reference(ref, samples, clip=0.05)
    assert_same_state(model, ref, exact=True)


def test_one_gradient_for_two_slots_is_unscaled_once_in_float16():
    entry = LAYOUT_BY_NAME["shared_gradient"]
    model = entry.model()
    ref = copy.deepcopy(model)
    samples = entry.samples(4)
    report = lt.train_samples(lt.Runner.from_module(model, "mse"),
                              lt.TrainConfig(steps=4, batch_size=1, optimizer=optim.sgd(0.1), log_every=0,
                                             autocast="float16"), samples)
    skips = _shared_reference(ref, samples, scaler=torch.amp.GradScaler("cpu"))
    assert report.skipped_steps == skips < 4  # the first scales overflow; later steps update
    assert_same_state(model, ref, exact=True)


def _sparse_reference(model, samples, opt_name):
    """torch.optim on the sparse embedding (its per-tensor sparse path: fused kernels refuse
    sparse gradients) and the fused kernel on the dense head, as leantrain runs them."""
    _, cls, kwargs, _ = OPTIMIZERS[opt_name]
    sparse = cls([model.emb.weight], **{k: v for k, v in kwargs.items() if k != "fused"})
    dense = cls(model.head.parameters(), **kwargs)
    for x, y in samples:
        model.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        sparse.step()
        dense.step()


@pytest.mark.parametrize("mirror", [False, True], ids=["host", "mirror"])
@pytest.mark.parametrize("opt_name", [name for name, case in TABLE.items() if case.sparse])
def test_sparse_embedding_trains_like_torch(opt_name, mirror):
    model = SPARSE.model()
    ref = copy.deepcopy(model)
    samples = SPARSE.samples(4)
    r = lt.Runner.from_module(model, "mse")
    if mirror:
        r.to("cpu")
    lt.train_samples(r, lt.TrainConfig(steps=4, batch_size=1, optimizer=OPTIMIZERS[opt_name][0], log_every=0),
                     samples)
    _sparse_reference(ref, samples, opt_name)
    # Momentum keeps a dense buffer (made at init); torch.optim.SGD's starts as a sparse copy
    # of the first gradient and stays sparse, so its repeated rows sum in another order
    # (SGDRule.update_sparse says so): equal to rounding there, bit for bit otherwise.
    dense_buffer = record_type(TABLE[opt_name].make().hyper) is MomentumState
    assert_same_state(model, ref, exact=not dense_buffer, rtol=1e-6)


@pytest.mark.parametrize("clip", [{"clip_grad_norm": 0.05}, {"clip_grad_value": 0.01}], ids=["norm", "value"])
def test_sparse_gradients_clip_and_accumulate_like_their_dense_form(clip):
    """torch's clip_grad_norm_ refuses sparse gradients; leantrain clips their coalesced
    values, which is the dense embedding's clipping to rounding, in list batches too."""
    samples = SPARSE.samples(6)
    models = []
    for sparse in (True, False):
        model = SPARSE.model()
        model.emb.sparse = sparse
        cfg = lt.TrainConfig(steps=3, batch_size=2, optimizer=optim.sgd(0.1), log_every=0, nonfinite="skip", **clip)
        lt.train_samples(lt.Runner.from_module(model, "mse"), cfg, samples)
        models.append(model)
    assert_same_state(models[0], models[1], exact=False, rtol=1e-6)
    assert not torch.equal(models[0].emb.weight, SPARSE.model().emb.weight)


@pytest.mark.parametrize("opt_name", ["momentum", "adam", "rmsprop"])
def test_sparse_gradients_with_rules_that_refuse_them(opt_name):
    model = SPARSE.model()
    r = lt.Runner.from_module(model, "mse")
    opt = OPTIMIZERS[opt_name][0]
    if opt_name == "momentum":  # torch.optim.SGD takes them with momentum too, and so do we
        lt.step_batch(r, opt, opt.init(r.params), False, SPARSE.samples(1))
        return
    state = opt.init(r.params)
    values = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(lt.PackError, match=rf"slot 0 \('emb.weight'\): got a sparse gradient, which {opt_name}"):
        lt.step_batch(r, opt, state, False, SPARSE.samples(1))
    assert all(torch.equal(values[k], v) for k, v in model.state_dict().items())
    assert all(torch.count_nonzero(t) == 0 for rec in state.records().values() for t in rec.tensors().values())
