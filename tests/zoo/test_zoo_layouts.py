"""Every tensor layout against plain PyTorch on a deep copy (issue: exact on every layout).

Interleaved, column and gapped views (guard elements around them must not change), a
transposed and a channels_last parameter used elementwise and through reshapes, a
stride-0 gradient beside BatchNorm, a top-1 mixture of experts with idle experts, an
input-dependent branch and an unused parameter, ``x * (a + b)``, spectral_norm: each
with every optimizer family, single-item steps (the loop a user writes, bit for bit
where the kernels are torch's) and list batches (the accumulation reference).
"""

import copy

import pytest
import torch

import leantrain as lt
from leantrain import optim
from layout_models import LAYOUT_BY_NAME, LAYOUT_ZOO
from oracle import OPTIMIZERS, assert_same_state, module_fingerprint, plain_loop, reference_steps


def _cfg(opt, **kw):
    return lt.TrainConfig(optimizer=opt, log_every=0, **kw)


def _idle(model) -> dict:
    """What the MoE's forward never gives a gradient: two experts and ``unused``."""
    names = ("experts.2.weight", "experts.2.bias", "experts.3.weight", "experts.3.bias", "unused")
    own = dict(model.named_parameters())
    return {n: own[n].detach().clone() for n in names}


class _PrimedSGD(torch.optim.SGD):
    """torch's fused SGD with momentum fails when a parameter gets its first gradient
    after the first step (a None buffer beside others: ``expected Tensor as element 1 in
    argument 2``), which an MoE's branches do. Zero buffers made up front avoid it with
    the same bits (``0*mu + g`` is ``g``); a parameter without a gradient is still skipped."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)


def _primed_momentum(monkeypatch, entry):
    if entry.name == "top1_moe":
        ours, _, kwargs, exact = OPTIMIZERS["momentum"]
        monkeypatch.setitem(OPTIMIZERS, "momentum", (ours, _PrimedSGD, kwargs, exact))


def _check_side_conditions(entry, model, guards, idle):
    if guards is not None:
        for before, now in zip(guards, model.guards()):
            assert torch.equal(before, now), "an element no parameter owns was written"
    if idle is not None:
        for name, value in idle.items():
            assert torch.equal(dict(model.named_parameters())[name], value), f"{name} moved without a gradient"


@pytest.mark.parametrize("mirror", [False, True], ids=["host", "mirror"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("entry", LAYOUT_ZOO, ids=lambda e: e.name)
def test_single_item_steps_equal_the_plain_loop(entry, opt_name, mirror, monkeypatch):
    _primed_momentum(monkeypatch, entry)
    opt, _, _, exact = OPTIMIZERS[opt_name]
    model = entry.model()
    ref = copy.deepcopy(model)
    guards = model.guards() if hasattr(model, "guards") else None
    idle = _idle(model) if entry.name == "top1_moe" else None
    before = module_fingerprint(model)
    samples = entry.samples(4)
    r = lt.Runner.from_module(model, entry.loss)
    if mirror:
        r.to("cpu")
    torch.manual_seed(11)
    lt.train_samples(r, _cfg(opt, steps=4, batch_size=1), samples)
    torch.manual_seed(11)
    plain_loop(ref, entry.loss_fn(), samples, opt_name)
    assert_same_state(model, ref, exact=exact, rtol=1e-5)
    _check_side_conditions(entry, model, guards, idle)
    assert module_fingerprint(model) == before


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("entry", LAYOUT_ZOO, ids=lambda e: e.name)
def test_accumulated_steps_equal_the_reference(entry, opt_name, monkeypatch):
    """List batches of three: buffers advance for every item first (spectral_norm's
    power iteration too), each item is differentiated at the advanced buffers, a slot
    gets the sum over the items that used it times 1/n, one torch.optim step."""
    _primed_momentum(monkeypatch, entry)
    opt = OPTIMIZERS[opt_name][0]
    model = entry.model()
    ref = copy.deepcopy(model)
    guards = model.guards() if hasattr(model, "guards") else None
    idle = _idle(model) if entry.name == "top1_moe" else None
    samples = entry.samples(6)
    torch.manual_seed(5)
    lt.train_samples(lt.Runner.from_module(model, entry.loss), _cfg(opt, steps=2, batch_size=3), samples)
    torch.manual_seed(5)
    reference_steps(ref, entry.loss_fn(), [samples[0:3], samples[3:6]], opt_name)
    assert_same_state(model, ref, exact=False, rtol=2e-5)
    _check_side_conditions(entry, model, guards, idle)


@pytest.mark.parametrize("opt_name", [n for n in OPTIMIZERS if n != "sgd"])
def test_unused_slots_keep_value_and_state_through_a_resume(opt_name, tmp_path):
    """No gradient, no update: idle experts and the unused parameter keep their values
    and their optimizer state (no momentum, no decay, no Adam step) across a checkpoint,
    and the resumed run is the uninterrupted one bit for bit."""
    entry = LAYOUT_BY_NAME["top1_moe"]
    opt = OPTIMIZERS[opt_name][0]
    samples = entry.samples(6)

    def run(model, steps, **kw):
        r = lt.Runner.from_module(model, entry.loss)
        return r, lt.train_samples(r, _cfg(opt, steps=steps, batch_size=1, **kw), samples)

    straight = entry.model()
    idle = _idle(straight)
    torch.manual_seed(3)
    run(straight, 6)
    _check_side_conditions(entry, straight, None, idle)

    torch.manual_seed(3)
    first = entry.model()
    run(first, 3, checkpoint_every=3, checkpoint_path=tmp_path / "moe.ckpt")
    resumed = entry.model(seed=7)  # other values: the checkpoint must bring them all
    r, _ = run(resumed, 6, resume_from=tmp_path / "moe.ckpt")
    assert_same_state(resumed, straight, exact=True)
    ck = lt.load_checkpoint(tmp_path / "moe.ckpt", lt.Runner.from_module(entry.model(), entry.loss), optimizer=opt)
    names = r.params.names
    fresh = opt.init(lt.Runner.from_module(entry.model(), entry.loss).params)  # what an untouched history holds
    for i, rec in ck.state.records().items():
        if names[i] in idle:
            assert all(torch.equal(t, fresh.slots[i].tensors()[k]) for k, t in rec.tensors().items()), names[i]
            assert getattr(rec, "step", 0) == 0, names[i]


def test_adamw_does_not_decay_a_parameter_the_model_never_uses():
    model = LAYOUT_BY_NAME["top1_moe"].model()
    before = model.unused.detach().clone()
    r = lt.Runner.from_module(model, "mse")
    lt.train_samples(r, _cfg(optim.adamw(0.1, 0.5), steps=3, batch_size=2), LAYOUT_BY_NAME["top1_moe"].samples(6))
    assert torch.equal(model.unused, before)
    ref = copy.deepcopy(LAYOUT_BY_NAME["top1_moe"].model())
    torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.5).step()  # no .grad anywhere: nothing moves
    assert torch.equal(ref.unused, before)


def test_numerics_torchlean_keeps_upstreams_zero_gradient():
    """Upstream has no "unused": its gradient is zero, so momentum and decay still move
    a slot the forward never read."""
    model = LAYOUT_BY_NAME["top1_moe"].model()
    before = model.unused.detach().clone()
    opt = optim.sgd(0.1, momentum=0.9, numerics="torchlean")
    r = lt.Runner.from_module(model, "mse")
    state = opt.init(r.params)
    state = lt.step_batch(r, opt, state, False, LAYOUT_BY_NAME["top1_moe"].samples(1))
    assert torch.equal(model.unused, before)  # a zero gradient on a zero buffer: still put
    idx = r.params.names.index("unused")
    assert torch.count_nonzero(state.slots[idx].buf) == 0
    adamw = optim.adamw(0.1, 0.5, numerics="torchlean")
    state = adamw.init(r.params)
    lt.step_batch(r, adamw, state, False, LAYOUT_BY_NAME["top1_moe"].samples(1))
    assert not torch.equal(model.unused, before)  # decayed, as upstream does


def _clipped_plain_loop(model, loss_fn, samples, max_norm):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1, fused=True)
    for x, y in samples:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(params, max_norm)  # over the .grads that exist
        opt.step()


@pytest.mark.parametrize("entry", LAYOUT_ZOO, ids=lambda e: e.name)
def test_clipping_in_skip_mode_equals_clip_grad_norm(entry):
    """The skip path (every written tensor kept or put back on the device) and clipping
    on strided parameters, stride-0 gradients and slots without a gradient."""
    model = entry.model()
    ref = copy.deepcopy(model)
    guards = model.guards() if hasattr(model, "guards") else None
    samples = entry.samples(4)
    torch.manual_seed(2)
    lt.train_samples(lt.Runner.from_module(model, entry.loss),
                     _cfg(optim.sgd(0.1), steps=4, batch_size=1, clip_grad_norm=0.05, nonfinite="skip"), samples)
    torch.manual_seed(2)
    _clipped_plain_loop(ref, entry.loss_fn(), samples, 0.05)
    assert_same_state(model, ref, exact=True)
    _check_side_conditions(entry, model, guards, None)
