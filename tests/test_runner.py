"""Runner and accumulation: per-slot gradients, buffers first, modes (spec §6, §7.1, §10.4)."""

import copy

import pytest
import torch
from torch import nn

import leantrain as lt
from leantrain import optim
from models import TiedNet, regression_batches


def test_runner_params_are_parameters_then_buffers():
    r = lt.Runner.from_module(TiedNet(), "mse")
    assert r.params.names == [
        "inp.weight", "mid.weight", "mid.bias", "norm.weight", "norm.bias", "out.weight",
        "norm.running_mean", "norm.running_var", "norm.num_batches_tracked",
    ]
    assert r.params.canonical_slot_indices() == [0, 1, 2, 3, 4, 1, None, None, None]


def test_aliases_receive_their_own_occurrence_gradients():
    torch.manual_seed(0)
    net = TiedNet(bn=False)
    r = lt.Runner.from_module(net, "mse")
    x, y = regression_batches(1, 5)[0]
    grads = lt.mean_gradients(r, [(x, y)])
    # the per-occurrence gradients, computed by hand with two separate leaves
    w = net.mid.weight.detach()
    w_mid, w_out = w.clone().requires_grad_(), w.clone().requires_grad_()
    h = torch.tanh(torch.tanh(x @ net.inp.weight.detach().T) @ w_mid.T + net.mid.bias.detach())
    loss = nn.functional.mse_loss(h @ w_out.T, y)
    g_mid, g_out = torch.autograd.grad(loss, [w_mid, w_out])
    torch.testing.assert_close(grads[1], g_mid, rtol=0, atol=0)
    torch.testing.assert_close(grads[3], g_out, rtol=0, atol=0)
    # and the optimizer applies their sum once, in slot order
    before = net.mid.weight.detach().clone()
    opt = optim.sgd(0.5)
    opt.step(opt.init(r.params), r.params, grads)
    assert torch.equal(net.mid.weight.detach(), before - 0.5 * (g_mid + g_out))


def test_tied_model_matches_untied_model_with_summed_gradients():
    torch.manual_seed(1)
    tied = TiedNet(bn=False)
    untied = copy.deepcopy(tied)
    untied.out.weight = nn.Parameter(tied.mid.weight.detach().clone())
    rt, ru = lt.Runner.from_module(tied, "mse"), lt.Runner.from_module(untied, "mse")
    opt = optim.adam(0.01)
    st, su = opt.init(rt.params), opt.init(ru.params)
    for x, y in regression_batches(6, 5):
        gt = lt.mean_gradients(rt, [(x, y)])
        gu = lt.mean_gradients(ru, [(x, y)])
        torch.testing.assert_close(gt[3], gu[3], rtol=1e-5, atol=1e-6)
        st = opt.step(st, rt.params, gt)
        # the untied run gets the summed gradient on both copies: they stay equal
        summed = gu[1] + gu[3]
        su = opt.step(su, ru.params, [gu[0], summed, gu[2], summed])
    torch.testing.assert_close(tied.mid.weight, untied.mid.weight, rtol=1e-5, atol=1e-6)
    assert torch.equal(untied.mid.weight, untied.out.weight)


def test_repeating_a_sample_keeps_the_mean_gradient_bit_for_bit():
    r = lt.Runner.from_module(TiedNet(bn=False), "mse")
    s = regression_batches(1, 3)[0]
    one, two = lt.mean_gradients(r, [s]), lt.mean_gradients(r, [s, s])
    for a, b in zip(one, two):
        assert (a is None and b is None) or torch.equal(a, b)


def test_list_batch_equals_one_stacked_minibatch():
    torch.manual_seed(2)
    r = lt.Runner.from_module(TiedNet(bn=False), "mse")
    items = [(x[0], y[0]) for x, y in regression_batches(6, 1)]
    listed = lt.mean_gradients(r, items)
    stacked = lt.mean_gradients(r, [(torch.stack([x for x, _ in items]), torch.stack([y for _, y in items]))])
    for a, b in zip(listed, stacked):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_vectorized_matches_exact_and_refuses_batchnorm():
    torch.manual_seed(3)
    r = lt.Runner.from_module(TiedNet(bn=False), "mse")
    items = [(x[0], y[0]) for x, y in regression_batches(8, 1)]
    loss_e, exact = lt.mean_loss_and_gradients(r, items)
    loss_v, vec = lt.mean_loss_and_gradients(r, items, accumulation="vectorized")
    assert loss_v == pytest.approx(loss_e, rel=1e-6)
    for a, b in zip(exact, vec):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    rb = lt.Runner.from_module(TiedNet(bn=True), "mse")
    before = [t.clone() for t in rb.params.values()]
    with pytest.raises(lt.ConfigError, match=r"module 'norm' \(BatchNorm1d\) couples the items"):
        lt.mean_gradients(rb, [(x.expand(2, 4), y.expand(2, 6)) for x, y in items[:2]], accumulation="vectorized")
    rb.eval()
    lt.mean_gradients(rb, items, accumulation="vectorized")  # eval mode: no coupling
    assert all(torch.equal(a, b) for a, b in zip(before, rb.params.values()))


def test_vectorized_with_a_callable_loss_and_minibatch_items():
    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(4, 3))
    r = lt.Runner.from_module(net, lambda p, y: ((p - y) ** 2).sum(-1).mean())
    items = regression_batches(5, 2, out=3)
    _, exact = lt.mean_loss_and_gradients(r, items)
    _, vec = lt.mean_loss_and_gradients(r, items, accumulation="vectorized")
    for a, b in zip(exact, vec):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_buffers_advance_for_every_item_before_differentiation():
    torch.manual_seed(5)
    net = TiedNet(bn=True)
    ref = copy.deepcopy(net)
    r = lt.Runner.from_module(net, "mse")
    batch = regression_batches(3, 4)
    grads = lt.mean_gradients(r, batch)
    with torch.no_grad():  # the reference: one buffer update per item, in order
        for x, _ in batch:
            ref(x)
    assert net.norm.num_batches_tracked.item() == 3
    assert torch.equal(net.norm.running_mean, ref.norm.running_mean)
    assert torch.equal(net.norm.running_var, ref.norm.running_var)
    assert grads[6] is None and grads[8] is None  # buffers are frozen slots


def test_eval_mode_uses_the_eval_program():
    """Dropout p=1: eval prediction 2.0, eval MSE 4.0, train-mode step loss 0 (spec §10.4)."""
    net = nn.Sequential(nn.Linear(1, 1), nn.Dropout(p=1.0))
    with torch.no_grad():
        net[0].weight.fill_(1.0)
        net[0].bias.fill_(0.0)
    r = lt.Runner.from_module(net, "mse")
    sample = (torch.tensor([2.0]), torch.tensor([0.0]))
    r.eval()
    assert net(sample[0]).item() == 2.0 and r.mean_loss([sample]) == 4.0
    r.train()
    opt = optim.sgd(0.1)
    state, loss = lt.step_batch_and_loss(r, opt, opt.init(r.params), False, [sample])
    assert loss == 0.0
    r.eval()
    assert r.mean_loss([sample]) == 4.0  # evaluation unchanged by training


def test_mean_loss_leaves_buffers_alone():
    r = lt.Runner.from_module(TiedNet(bn=True), "mse")
    before = [t.clone() for t in r.params.values()]
    r.mean_loss(regression_batches(2, 4))
    assert all(torch.equal(a, b) for a, b in zip(before, r.params.values()))


def test_mixed_batch_sizes_with_and_without_loss_match_the_singleton_run():
    torch.manual_seed(6)
    a, b = TiedNet(bn=False), None
    b = copy.deepcopy(a)
    ra, rb = lt.Runner.from_module(a, "mse"), lt.Runner.from_module(b, "mse")
    opt = optim.adam(0.01)
    sa, sb = opt.init(ra.params), opt.init(rb.params)
    for k, s in enumerate(regression_batches(6, 3)):
        if k % 2:
            sa, _ = lt.step_batch_and_loss(ra, opt, sa, False, [s] * (k + 1))
        else:
            sa = lt.step_batch(ra, opt, sa, False, [s] * (k + 1))
        sb = lt.step_batch(rb, opt, sb, False, [s])
    for x, y in zip(ra.params.values(), rb.params.values()):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-4)


def test_step_loss_is_measured_before_the_update():
    r = lt.Runner.from_module(TiedNet(bn=False), "mse")
    s = regression_batches(1, 4)[0]
    expected = r.mean_loss([s])
    opt = optim.sgd(0.5)
    _, loss = lt.step_batch_and_loss(r, opt, opt.init(r.params), False, [s])
    assert loss == pytest.approx(expected, rel=1e-6)
    assert r.mean_loss([s]) != pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    "batch, error, pattern",
    [
        ([], lt.DataError, "step_batch: empty batch"),
        ([(torch.zeros(4),)], lt.DataError, r"step_batch: item 0: expected an \(x, y\) pair"),
        ("xy", lt.DataError, "a batch is a list of"),
    ],
)
def test_bad_batches_change_nothing(batch, error, pattern, unchanged):
    r = lt.Runner.from_module(TiedNet(bn=True), "mse")
    opt = optim.adam(0.1)
    state = opt.init(r.params)
    with unchanged(r.params, state), pytest.raises(error, match=pattern):
        lt.step_batch(r, opt, state, False, batch)


def test_wrong_path_rejected_before_buffers_move(unchanged):
    r = lt.Runner.from_module(TiedNet(bn=True), "mse")
    opt = optim.adam(0.1)
    state = opt.init(r.params)
    with unchanged(r.params, state), pytest.raises(lt.OptimizerStateError, match="cannot mix"):
        lt.step_batch(r, opt, state, True, regression_batches(2, 4))


def test_runner_rejects_unknown_loss():
    with pytest.raises(lt.ConfigError, match="unknown loss 'mae'"):
        lt.Runner.from_module(nn.Linear(1, 1), "mae")


def test_a_taken_gradient_leaves_the_step_result_and_a_real_expanded_one_is_copied():
    """A reducer's hook hands autograd ``backward.taken(g)``: the step's result then has
    ``None`` there (nothing gradient-sized kept); an expand's stride-0 gradient made by
    autograd is still copied into memory of its own; a one-element gradient is its own
    stand-in."""
    from leantrain.training.runner.backward import own_gradients, taken

    w, b, s = torch.zeros(3, 4), torch.zeros(4), torch.zeros(1)
    g = torch.ones(3, 4)
    stand_in = taken(g)
    assert stand_in.shape == g.shape and stand_in.untyped_storage().nbytes() == g.element_size()
    real = torch.ones(()).expand(4)  # what autograd gives for an expand: not a stand-in
    one = torch.ones(1)
    out = own_gradients([stand_in, real, taken(one)], [w, b, s])
    assert out[0] is None
    assert out[1] is not real and out[1].stride() == (1,) and torch.equal(out[1], torch.ones(4))
    assert out[2] is one
