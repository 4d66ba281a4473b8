"""Every optimizer whose torch counterpart has a fused kernel (SGD, momentum, Adagrad, Adam,
AdamW: read from the shared table) runs that kernel: on every zoo model without a tie,
leantrain's steps equal ``torch.optim``'s with ``fused=True`` bit for bit (host and
native paths); a tie agrees to rounding (two occurrences summed)."""


import pytest
import torch

import leantrain as lt
from leantrain import optim
from optimizer_table import TABLE
from oracle import assert_same_state, run_both
from zoo_models import ZOO

FUSED = [name for name, case in TABLE.items() if case.torch()[1].get("fused")]


@pytest.mark.parametrize("mirror", [False, True], ids=["host", "mirror"])
@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
def test_adam_equals_torch_fused_bit_for_bit(entry, name, mirror):
    cls, kwargs = TABLE[name].torch()

    def fused_loop(ref, batches):  # single items: the gradients are autograd's own, so only the update is compared
        topt = cls([p for p in ref.parameters() if p.requires_grad], **kwargs)
        for [(x, y)] in batches:
            topt.zero_grad(set_to_none=True)
            entry.loss_fn()(ref(x), y).backward()
            topt.step()

    both = run_both(entry, name, lt.TrainConfig(steps=4, batch_size=1, log_every=0), mirror=mirror,
                    reference=fused_loop)
    assert_same_state(both.model, both.ref, exact=not entry.tied, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_one_tensor_alone_equals_the_group(dtype):
    from leantrain.optim import rules as R
    from leantrain.optim.hyper import AdamW

    g = torch.Generator().manual_seed(0)
    h = AdamW(0.01, 0.1)
    ps = [torch.randn(n, generator=g).to(dtype) for n in (3, 7, 1)]
    gs = [torch.randn(p.shape, generator=g).to(dtype) for p in ps]
    one = [p.clone() for p in ps]
    ss = [R.AdamRule.init(h, p) for p in ps]
    ss1 = [R.AdamRule.init(h, p) for p in ps]
    for _ in range(3):
        ss = R.AdamRule.update_many(h, 0.01, ss, ps, gs)
        ss1 = [R.AdamRule.update_many(h, 0.01, [s], [p], [gr])[0] for s, p, gr in zip(ss1, one, gs)]
    assert all(torch.equal(a, b) for a, b in zip(ps, one))
    assert all(torch.equal(a.m, b.m) and torch.equal(a.v, b.v) and a.step == b.step == 3 for a, b in zip(ss, ss1))


def test_a_tiny_eps_and_a_zero_gradient_stay_finite():
    p = lt.Param(torch.ones(4), name="w")
    params = lt.ParamList([p])
    opt = optim.adam(0.1, eps=1e-45)
    state = opt.init(params)
    for _ in range(3):
        state = opt.step(state, params, [torch.zeros(4)])
    assert torch.isfinite(params.values()[0]).all()


@pytest.mark.parametrize("entry", [e for e in ZOO if not e.tied], ids=lambda e: e.name)
def test_public_steps_that_keep_their_layout_equal_torch_fused_adamw(entry, monkeypatch):
    """``Optimizer.step`` called by hand, as a PyTorch script would, keeps its layout from
    the first call (``optim/layout.py``'s memo) and still gives ``AdamW(fused=True)``'s bits
    on a deep copy, for every zoo model (buffers and frozen slots without a gradient)."""
    import copy

    from leantrain.optim import optimizer as optimizer_module

    built, real = [], optimizer_module.build_layout

    def counted(*args, **kwargs):
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(optimizer_module, "build_layout", counted)
    model = entry.model(0)
    ref = copy.deepcopy(model)
    params = lt.ParamList.from_module(model)
    opt = optim.adamw(1e-2, weight_decay=0.1)
    state = opt.init(params)
    topt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1, fused=True)
    named = dict(model.named_parameters())
    for k, (x, y) in enumerate(entry.samples(4)):
        trained = {n: p for n, p in named.items() if p.requires_grad}
        torch.manual_seed(k)  # the same dropout draws on both sides
        found = torch.autograd.grad(entry.loss_fn()(model(x), y), list(trained.values()), allow_unused=True)
        by_name = dict(zip(trained, found))
        state = opt.step(state, params, [by_name.get(v.name) for v in params])
        topt.zero_grad(set_to_none=True)
        torch.manual_seed(k)
        entry.loss_fn()(ref(x), y).backward()
        topt.step()
    assert len(built) == 1  # the first call's layout served the other three
    for (name, ours), theirs in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(ours, theirs), name
