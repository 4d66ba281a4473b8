"""Mean gradients on every zoo model against plain autograd on a deep copy."""

import copy

import pytest
import torch

import leantrain as lt
from oracle import gradient_scale, reference_gradients, relative_difference
from zoo_models import ZOO

MIRRORS = [False, True]


def _runner(entry, model, mirror):
    r = lt.Runner.from_module(model, entry.loss)
    return r.to("cpu") if mirror else r


def _canonical(runner, grads):
    """Representative slot name -> summed gradient (each storage once)."""
    sums = lt.canonical_gradients(runner.params.canonical_slot_indices(), grads)
    return {
        runner.params[i].name: sums[i]
        for i, c in enumerate(runner.params.canonical_slot_indices()) if c == i
    }


@pytest.mark.parametrize("mirror", MIRRORS, ids=["host", "mirror"])
@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
def test_mean_gradients_equal_autograd_of_the_mean(entry, mirror):
    model = entry.model()
    ref = copy.deepcopy(model)
    batch = entry.samples(3)
    r = _runner(entry, model, mirror)
    torch.manual_seed(7)
    ours = _canonical(r, lt.mean_gradients(r, batch))
    torch.manual_seed(7)
    reference_gradients(ref, entry.loss_fn(), batch)
    theirs = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert sorted(ours) == sorted(theirs)
    scale = gradient_scale(theirs.values())
    for name, g in theirs.items():
        assert relative_difference(ours[name], g, scale) <= 1e-6, name
    # the buffers moved exactly as the contract's buffer pass moves them
    for (k, a), (_, b) in zip(r.module.state_dict().items(), ref.state_dict().items()):
        if not mirror:
            assert torch.equal(a, b), k


@pytest.mark.parametrize("mirror", MIRRORS, ids=["host", "mirror"])
@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
def test_single_item_gradient_is_autograds_bit_for_bit(entry, mirror):
    model = entry.model()
    ref = copy.deepcopy(model)
    (x, y), = entry.samples(1)
    r = _runner(entry, model, mirror)
    torch.manual_seed(3)
    ours = _canonical(r, lt.mean_gradients(r, [(x, y)]))
    torch.manual_seed(3)
    entry.loss_fn()(ref(x), y).backward()
    for name, p in ref.named_parameters():
        if p.requires_grad:
            # a tie's sum is two additions in another order: equal to rounding only
            if entry.tied and name == "tok_emb.weight":
                assert relative_difference(ours[name], p.grad) <= 1e-6, name
            else:
                assert torch.equal(ours[name], p.grad), name


def test_a_tie_with_a_buffer_gets_both_occurrences():
    """The reported bug: a tie plus any buffer dropped one occurrence's gradient."""

    class TiedWithBuffer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 3, bias=False)
            self.b = torch.nn.Linear(3, 3, bias=False)
            self.b.weight = self.a.weight
            self.register_buffer("c", torch.ones(3))

        def forward(self, x):
            return self.b(torch.tanh(self.a(x))) * self.c

    torch.manual_seed(0)
    model = TiedWithBuffer()
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    r = lt.Runner.from_module(model, "mse")
    g = lt.canonical_gradients(r.params.canonical_slot_indices(), lt.mean_gradients(r, [(x, y)]))[0]
    torch.nn.functional.mse_loss(ref(x), y).backward()
    assert relative_difference(g, ref.a.weight.grad) <= 1e-6


def _count_forwards(name, items, steps):
    """Forward calls per step of ``steps`` updates on ``items``-item batches."""
    from zoo_models import BY_NAME

    entry = BY_NAME[name]
    model = entry.model()
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    r = lt.Runner.from_module(model, entry.loss)
    batch = entry.samples(items)
    opt = lt.optim.sgd(0.1)
    state = opt.init(r.params)
    per_step = []
    for _ in range(steps):
        before = len(calls)
        state = lt.step_batch(r, opt, state, False, batch)
        per_step.append(len(calls) - before)
    return r, per_step


def test_constant_buffers_cost_no_extra_forward():
    r, per_step = _count_forwards("constant_buffer", 3, 3)
    assert per_step == [3, 3, 3]  # one forward per item, from the first step on
    assert (r.stats.buffer_passes, r.stats.redone_steps) == (0, 0)


def test_a_model_that_writes_buffers_pays_the_pass():
    r, per_step = _count_forwards("cnn_batchnorm", 2, 3)
    # first step: a scratch attempt, then the buffer pass and the gradients; then 2 + 2
    assert per_step == [6, 4, 4]
    assert (r.stats.buffer_passes, r.stats.redone_steps) == (3, 1)

@pytest.mark.cuda
@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
def test_on_cuda_gradients_and_the_module_match_the_host(entry):
    """The same contract on a CUDA device (mirrors), against the CPU reference."""
    from oracle import module_fingerprint

    model = entry.model()
    ref = copy.deepcopy(model)
    before = module_fingerprint(model)
    batch = entry.samples(3)
    r = lt.Runner.from_module(model, entry.loss).to("cuda")
    opt = lt.optim.adam(0.01)
    state = opt.init(r.params, native=True)
    torch.manual_seed(7)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # cuDNN's LSTM: TF32 by default
        ours = {k: v.cpu() for k, v in _canonical(r, lt.mean_gradients(r, [(x.cuda(), y.cuda()) for x, y in batch])).items()}
    reference_gradients(ref, entry.loss_fn(), batch)
    scale = gradient_scale([p.grad for p in ref.parameters() if p.requires_grad])
    if "dropout" not in str(model).lower():  # CUDA draws other random numbers than the CPU
        for n, p in ref.named_parameters():
            if p.requires_grad:
                assert relative_difference(ours[n], p.grad, scale) <= 1e-5, n
    lt.step_batch(r, opt, state, True, batch)
    r.sync()
    assert module_fingerprint(model) == before
    assert all(p.device.type == "cpu" for p in model.parameters())
