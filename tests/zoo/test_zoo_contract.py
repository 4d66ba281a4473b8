"""What the Runner refuses, what it leaves alone, and what a rejected step undoes."""

import copy

import pytest
import torch
from torch import nn

import leantrain as lt
from leantrain import optim, weights
from oracle import reference_gradients
from zoo_models import BY_NAME, CharGPT


def buffers_of(model):
    return {k: v.clone() for k, v in model.named_buffers()}


def assert_buffers_equal(model, saved):
    for k, v in model.named_buffers():
        assert torch.equal(v.reshape(-1).view(torch.uint8), saved[k].reshape(-1).view(torch.uint8)), k


# ------------------------------------------------------------------ refusals
def test_a_lazy_module_is_refused_with_the_reason():
    with pytest.raises(lt.ConfigError, match=r"slot 0 \('0.weight'\) is an uninitialized \(lazy\)"):
        lt.Runner.from_module(nn.Sequential(nn.LazyLinear(3)), "mse")


@pytest.mark.parametrize("what", ["parameter", "buffer"])
def test_a_module_changed_after_the_runner_was_built_is_refused(what, unchanged):
    entry = BY_NAME["cnn_batchnorm"]
    model = entry.model()
    r = lt.Runner.from_module(model, entry.loss)
    opt = optim.sgd(0.1)
    state = opt.init(r.params)
    if what == "parameter":
        model.head.weight = nn.Parameter(torch.zeros_like(model.head.weight))
        match = r"slot 3 \('head.weight'\): the module's parameter was replaced"
    else:
        model.bn.running_mean = torch.zeros(4)
        match = r"\('bn.running_mean'\): the module's buffer was replaced"
    with unchanged(r.params, state), pytest.raises(lt.ConfigError, match=match):
        lt.step_batch(r, opt, state, False, entry.samples(2))


# ------------------------------------------------------------------ aliases
def test_zero_size_parameters_are_never_tied():
    m = nn.Module()
    m.a, m.b = nn.Parameter(torch.empty(0)), nn.Parameter(torch.empty(0, 3))
    m.c = m.a  # the same object twice is a tie, even with no elements
    params = lt.ParamList.from_module(m)
    assert params.canonical_slot_indices() == [0, 1, 0]


def test_strided_views_without_a_shared_element_are_separate_storages():
    base = torch.arange(12.0)
    m = nn.Module()
    m.even, m.odd = nn.Parameter(base[0::2]), nn.Parameter(base[1::2])
    m.rows = nn.Parameter(torch.zeros(4, 6)[:, :3])
    m.other_rows = nn.Parameter(m.rows.data.as_strided((4, 3), (6, 1), m.rows.data.storage_offset() + 3))
    assert lt.ParamList.from_module(m).canonical_slot_indices() == [0, 1, 2, 3]


def test_a_true_partial_overlap_is_still_refused():
    base = torch.arange(12.0)
    m = nn.Module()
    m.a, m.b = nn.Parameter(base[0:6]), nn.Parameter(base[4:10])
    with pytest.raises(lt.AliasError, match=r"slot 0 \('a'\) and slot 1 \('b'\) overlap in memory"):
        lt.ParamList.from_module(m)
    m2 = nn.Module()
    m2.a, m2.b = nn.Parameter(base[0::2]), nn.Parameter(base[0::3])  # share elements 0 and 6
    with pytest.raises(lt.AliasError, match="overlap in memory"):
        lt.ParamList.from_module(m2)


# -------------------------------------------------------- non-persistent buffers
def test_non_persistent_buffers_are_not_slots_and_exports_load_into_the_model(tmp_path):
    model = CharGPT(persistent_mask=False)
    r = lt.Runner.from_module(model, "cross_entropy")
    assert "mask" not in r.params.names
    assert r.params.names == list(model.state_dict().keys())
    fresh = CharGPT(persistent_mask=False)
    fresh.load_state_dict(weights.export_state_dict(r))  # strict: every key matches
    weights.save_weights(tmp_path / "w.safetensors", r)
    assert weights.load_weights(tmp_path / "w.safetensors", lt.Runner.from_module(fresh, "mse")) == []
    lt.save_checkpoint(tmp_path / "c.ckpt", r)
    lt.load_checkpoint(tmp_path / "c.ckpt", lt.Runner.from_module(CharGPT(persistent_mask=False), "mse"))


def test_a_persistent_mask_is_a_frozen_slot():
    r = lt.Runner.from_module(CharGPT(persistent_mask=True), "cross_entropy")
    assert r.params.names[-1] == "mask" and not r.params[len(r.params) - 1].requires_grad


# ------------------------------------------------------- rejected steps undo buffers
def _bn_runner(mirror=False):
    entry = BY_NAME["cnn_batchnorm"]
    model = entry.model()
    r = lt.Runner.from_module(model, entry.loss)
    if mirror:
        r.to("cpu")
    opt = optim.sgd(0.1)
    state = opt.init(r.params, native=mirror)
    state = lt.step_batch(r, opt, state, mirror, entry.samples(2))  # buffers are known to move
    return entry, model, r, opt, state


@pytest.mark.parametrize("mirror", [False, True], ids=["host", "mirror"])
def test_a_non_finite_input_raises_with_buffers_untouched(mirror, unchanged):
    entry, model, r, opt, state = _bn_runner(mirror)
    (x, y), = entry.samples(1)
    saved = buffers_of(model) if not mirror else [b.clone() for b in r.params.values_synced()]
    with unchanged(r.params, state), pytest.raises(lt.NonFiniteError, match="buffers included"):
        lt.step_batch(r, opt, state, mirror, [(x.fill_(float("inf")), y)])
    if not mirror:
        assert_buffers_equal(model, saved)


def test_a_skipped_step_leaves_buffers_as_they_were():
    entry, model, r, opt, state = _bn_runner()
    saved = buffers_of(model)
    (x, y), = entry.samples(1)
    skipped = torch.zeros(())
    before = [p.clone() for p in model.parameters()]
    state = lt.step_batch(r, opt, state, False, [(x.fill_(float("nan")), y)], nonfinite="skip", skipped=skipped)
    assert int(skipped) == 1
    assert_buffers_equal(model, saved)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert torch.isfinite(r.predict(entry.samples(1)[0][0])).all()


def test_a_step_rejected_during_the_gradient_pass_restores_buffers(unchanged):
    entry, model, r, opt, state = _bn_runner()
    saved = buffers_of(model)
    (x, y), = entry.samples(1)
    bad = [(x, y), (x, torch.zeros(5, dtype=torch.long))]  # wrong target size: the loss raises
    with unchanged(r.params, state), pytest.raises(lt.DataError, match="rejected the sample"):
        lt.step_batch(r, opt, state, False, bad)
    assert_buffers_equal(model, saved)


def test_a_model_error_in_the_buffer_pass_restores_buffers_and_the_rng(unchanged):
    entry, model, r, opt, state = _bn_runner()
    saved = buffers_of(model)
    good, = entry.samples(1)
    bad = (torch.randn(2, 3), good[1])  # not an image: the model raises in the buffer pass
    rng = torch.get_rng_state()
    with unchanged(r.params, state), pytest.raises(lt.DataError):
        lt.step_batch(r, opt, state, False, [good, bad])
    assert_buffers_equal(model, saved)
    assert torch.equal(torch.get_rng_state(), rng)


def test_measuring_does_not_move_buffers_or_draw_random_numbers():
    entry = BY_NAME["cnn_batchnorm"]  # BatchNorm and Dropout, in train mode
    model = entry.model()
    r = lt.Runner.from_module(model, entry.loss)
    saved, rng = buffers_of(model), torch.get_rng_state()
    a = r.mean_loss(entry.samples(3))
    assert a == r.mean_loss(entry.samples(3))
    assert torch.equal(torch.get_rng_state(), rng)
    r.predict(entry.samples(1)[0][0])  # a plain forward: it draws its dropout mask
    assert_buffers_equal(model, saved)


def test_a_model_that_starts_writing_buffers_later_is_redone_exactly():
    class Late(nn.Module):
        """Writes its buffer only once armed (after its first step)."""

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)
            self.register_buffer("seen", torch.zeros(3))

        def forward(self, x):
            if getattr(self, "armed", False):
                self.seen.add_(x.mean(0))
            return self.lin(x + self.seen)

    torch.manual_seed(0)
    model = Late()
    ref = copy.deepcopy(model)
    r = lt.Runner.from_module(model, "mse")
    data = [(torch.randn(2, 3), torch.randn(2, 2)) for _ in range(2)]
    opt = optim.sgd(0.1)
    state = lt.step_batch(r, opt, opt.init(r.params), False, data)
    assert (r.stats.buffer_passes, r.stats.redone_steps) == (0, 0)  # nothing written: no buffer pass
    model.armed = ref.armed = True
    state = lt.step_batch(r, opt, state, False, data)
    assert (r.stats.buffer_passes, r.stats.redone_steps) == (1, 1)  # seen writing: redone with the pass
    # the reference: the first step writes nothing; the second advances `seen` by both items first
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref.armed = False
    reference_gradients(ref, nn.functional.mse_loss, data)
    ref_opt.step()
    ref.armed = True
    reference_gradients(ref, nn.functional.mse_loss, data)
    ref_opt.step()
    for (k, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=k)
