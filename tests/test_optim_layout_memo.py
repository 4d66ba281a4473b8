"""A public ``step`` keeps its layout for the next call with the state it returned, and
builds a fresh one whenever anything the layout depends on changed (issue #35: checks
once, not per tensor per update, outside loops too)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from leantrain import Param, ParamList, errors, optim
from leantrain.optim import layout as layout_module
from leantrain.optim import optimizer as optimizer_module


@pytest.fixture
def builds(monkeypatch):
    """How many layouts the optimizer built (the count injected around ``build_layout``)."""
    count = [0]
    real = optimizer_module.build_layout

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(optimizer_module, "build_layout", counted)
    return count


class Forgetful(dict):
    """A memo that keeps nothing: every call builds its layout (the reference behaviour)."""

    def __setitem__(self, key, value) -> None:
        return None


def tied_params() -> ParamList:
    g = torch.Generator().manual_seed(0)
    shared = Param(torch.randn(4, 3, generator=g), name="shared")
    bias = Param(torch.randn(5, generator=g), name="bias")
    return ParamList([shared, bias, Param.of_storage(shared.storage, name="tie")])


def gradients(step: int) -> list:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(4, 3, generator=g), torch.randn(5, generator=g), torch.randn(4, 3, generator=g)]


def run(steps: int, opt) -> tuple[list, optim.OptState]:
    params = tied_params()
    state = opt.init(params)
    for k in range(steps):
        state = opt.step(state.with_lr(1e-2 / (k + 1)), params, gradients(k))
    return [t.clone() for t in params.values()], state


def test_a_kept_layout_gives_the_bits_of_a_fresh_one_each_call(builds, monkeypatch):
    opt = optim.adamw(1e-2, weight_decay=0.1)
    kept, kept_state = run(5, opt)
    assert builds[0] == 1  # the first call's layout served the four later ones (a schedule's with_lr included)
    monkeypatch.setattr(optimizer_module, "MEMO", Forgetful())
    fresh, fresh_state = run(5, opt)
    assert builds[0] == 1 + 5
    assert all(torch.equal(a, b) for a, b in zip(kept, fresh))
    for a, b in zip(kept_state.records().values(), fresh_state.records().values()):
        assert all(torch.equal(x, y) for x, y in zip(a.tensors().values(), b.tensors().values()))


def test_anything_the_layout_depends_on_changing_builds_a_new_one(builds):
    opt = optim.adam(1e-2)
    params = tied_params()
    first = opt.init(params)
    state = opt.step(first, params, gradients(0))
    state = opt.step(state, params, gradients(1))
    assert builds[0] == 1
    opt.step(first, params, gradients(2))  # an older state: its records are checked again
    assert builds[0] == 2
    other = optim.adam(1e-2)
    other.step(state, params, gradients(2))  # another optimizer object
    assert builds[0] == 3
    params[1].requires_grad = False  # a slot frozen between calls: the slots' map changed
    before = params[1].storage.host.clone()
    frozen = opt.step(opt.init(params), params, gradients(3))
    assert builds[0] == 4 and torch.equal(params[1].storage.host, before) and frozen.slots[1] is None
    params[1].requires_grad = True
    state = opt.step(opt.init(params), params, gradients(4))
    state = opt.step(state, params, gradients(5))
    params.to_device("cpu")  # device mirrors: the targets changed (a host update syncs and drops them)
    count = builds[0]
    state = opt.step(state, params, gradients(6))
    state = opt.step(state, params, gradients(7))
    assert builds[0] == count + 2  # the mirror's sync, then the host without it
    state = opt.step(state, params, gradients(8))
    assert builds[0] == count + 2
    missing = [gradients(9)[0], None, gradients(9)[2]]  # a slot without a gradient: another pattern
    state = opt.step(state, params, missing)
    state = opt.step(state, params, missing)
    assert builds[0] == count + 3
    with pytest.raises(errors.PackError, match="sparse"):
        opt.step(state, params, [gradients(8)[0], gradients(8)[1].to_sparse(), gradients(8)[2]])


def test_a_rejected_call_after_a_kept_layout_changes_nothing(builds):
    opt = optim.adam(1e-2)
    params = tied_params()
    state = opt.step(opt.init(params), params, gradients(0))
    state = opt.step(state, params, gradients(1))
    values = [t.clone() for t in params.values()]
    records = {i: [t.clone() for t in r.tensors().values()] for i, r in state.records().items()}
    with pytest.raises(errors.PackError, match="shape"):
        opt.step(state, params, [gradients(2)[0], torch.zeros(6), gradients(2)[2]])
    with pytest.raises(errors.PackError, match="sparse"):
        opt.step(state, params, [gradients(2)[0], gradients(2)[1].to_sparse(), gradients(2)[2]])
    assert all(torch.equal(a, b) for a, b in zip(params.values(), values))
    for i, r in state.records().items():
        assert all(torch.equal(a, b) for a, b in zip(r.tensors().values(), records[i]))


def test_the_memo_keeps_no_parameter_list_alive():
    opt = optim.adam(1e-2)
    params = tied_params()
    state = opt.step(opt.init(params), params, gradients(0))
    assert params in layout_module.MEMO
    gone = weakref.ref(params)
    del params, state
    gc.collect()
    assert gone() is None


def test_the_native_path_keeps_its_layout_once_the_mirrors_are_newer(builds, monkeypatch):
    def native_run(opt) -> list:
        params = tied_params().to_device("cpu")  # CPU mirrors stand for a device's
        state = opt.init(params, native=True)
        for k in range(4):
            state = opt.step_native(state, params, gradients(k))
        return [t.clone() for t in params.values_synced()]

    opt = optim.adam(1e-2)
    kept = native_run(opt)
    assert builds[0] == 2  # the first call found the host current; from the second the mirrors are newer
    monkeypatch.setattr(optimizer_module, "MEMO", Forgetful())
    assert all(torch.equal(a, b) for a, b in zip(kept, native_run(opt)))
    assert builds[0] == 2 + 4
