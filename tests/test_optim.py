"""Optimizers: one registry drives the contract tests (spec §3-§5, §10.1-§10.4)."""

import math

import pytest
import torch

import leantrain as lt
from leantrain import Param, ParamList, optim
from leantrain.optim import classic_rules, rules
from leantrain.optim.rules import rule_for

from leantrain.optim.muon_torch import MuonWithAdamW
from optimizer_table import NATIVE, TABLE, HandLion

REGISTRY = {name: case.make for name, case in TABLE.items()}


def test_the_table_covers_every_optimizer():
    """A rule added to the library without a case in the shared table fails here."""
    assert {case.kind for case in TABLE.values()} == set(optim.OPTIMIZERS) == set(rules.HYPERS)
    assert {type(rule_for(case.opt.hyper)) for case in TABLE.values()} == {type(r) for r in rules.RULES}


def quadratic_grads(params, target):
    return [2 * (v - target) if p.requires_grad else None for p, v in zip(params, params.values())]


@pytest.mark.parametrize("name", REGISTRY)
def test_converges_on_a_quadratic(name):
    opt = (TABLE[name].faster or TABLE[name].make)()
    params = ParamList.of_pack([torch.full((3,), 5.0, dtype=torch.float64)])
    state = opt.init(params)
    start = (params.values()[0] - 1.0).abs().max().item()
    for _ in range(300):
        state = opt.step(state, params, quadratic_grads(params, 1.0))
    assert (params.values()[0] - 1.0).abs().max().item() < 0.1 * start
    assert state.steps == 300


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name", REGISTRY)
def test_dtype_kept_and_frozen_slots_bit_identical(name, dtype):
    opt = REGISTRY[name]()
    frozen = Param(torch.randn(4).to(dtype), requires_grad=False)
    p = Param(torch.randn(4).to(dtype))
    params = ParamList([frozen, p, frozen.view(), p.view(requires_grad=False)])
    before = frozen.storage.host.clone()
    state = opt.init(params)
    assert state.slots[0] is None and state.slots[2] is None and state.slots[3] is None
    for k in range(5):
        g = torch.randn(4).to(dtype)
        state = opt.step(state, params, [torch.randn(4).to(dtype), g, None, g])
    assert torch.equal(frozen.storage.host.view(torch.uint8), before.view(torch.uint8))
    assert p.storage.host.dtype == dtype
    for rec in state.records().values():
        assert all(t.dtype == dtype for t in rec.tensors().values())


@pytest.fixture(params=["fused", "fallback"])
def kernels(request, monkeypatch):
    """Both forms of every rule: torch's fused kernels (what runs on CPU and CUDA float
    tensors) and the foreach/per-tensor fallback (what runs elsewhere), forced here."""
    if request.param == "fallback":
        monkeypatch.setattr(classic_rules, "fusable", lambda ps, cuda=True: False)
    return request.param


@pytest.mark.parametrize("name", REGISTRY)
def test_one_tensor_alone_gets_the_bits_it_gets_in_a_group(name, kernels):
    """Every form is elementwise: a group's update equals each tensor's update alone, for
    the fused kernels and for the foreach fallbacks (mixed shapes, one of them 0-dim)."""
    opt = REGISTRY[name]()
    h, rule = opt.hyper, rule_for(opt.hyper)
    gen = torch.Generator().manual_seed(7)
    shapes = [(3,), (2, 5), (), (7,)]
    ps = [torch.randn(s, generator=gen) for s in shapes]
    ref = [p.clone() for p in ps]
    recs = [rule.init(h, p) for p in ps]
    ref_recs = [rule.init(h, p) for p in ref]
    for step in range(6):
        gs = [torch.randn(s, generator=gen) for s in shapes]
        lr = 0.1 / (step + 1)
        recs = rule.update_many(h, lr, recs, ps, gs)
        ref_recs = [rule.update_many(h, lr, [r], [p], [g])[0] for r, p, g in zip(ref_recs, ref, gs)]
    for a, b in zip(ps, ref):
        assert torch.equal(a, b)
    for ra, rb in zip(recs, ref_recs):
        for (ka, ta), (kb, tb) in zip(ra.tensors().items(), rb.tensors().items()):
            assert torch.equal(ta, tb), ka


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("name", REGISTRY)
def test_tied_equals_independent_summed_bit_for_bit(name, native):
    """[p, q, p] with (a, b, c) follows [p', q'] with (a + c, b) exactly, over 6 steps."""
    if native and name not in NATIVE:
        pytest.skip("no native path")
    opt = REGISTRY[name]()
    p, q = Param(torch.tensor([1.0, -2.0])), Param(torch.tensor([0.5]))
    p2, q2 = Param(torch.tensor([1.0, -2.0])), Param(torch.tensor([0.5]))
    tied, indep = ParamList([p, q, p]), ParamList([p2, q2])
    if native:
        tied.to_device("cpu"), indep.to_device("cpu")
    s1, s2 = opt.init(tied, native=native), opt.init(indep, native=native)
    step = opt.step_native if native else opt.step
    for k in range(6):
        a = torch.full((2,), k + 1.0)
        b = torch.full((1,), k + 3.0)
        c = torch.full((2,), k + 5.0)
        s1 = step(s1, tied, [a, b, c])
        s2 = step(s2, indep, [a + c, b])
    assert torch.equal(tied.values_synced()[0], indep.values_synced()[0])
    assert torch.equal(tied.values_synced()[1], indep.values_synced()[1])
    for r1, r2 in zip([s1.slots[0], s1.slots[1]], [s2.slots[0], s2.slots[1]]):
        for t1, t2 in zip(r1.tensors().values(), r2.tensors().values()):
            assert torch.equal(t1, t2)
    if native:
        assert s1.slots[2] is None  # aliases own no native history
    else:
        assert s1.slots[2] is s1.slots[0]


def test_session_sgd_applies_the_summed_gradient_once():
    p = Param(torch.tensor(5.0))
    params = ParamList([p, p])
    opt = optim.sgd(0.25)
    opt.step(opt.init(params), params, [torch.tensor(2.0), torch.tensor(3.0)])
    assert p.storage.host.item() == 3.75


def _torch_run(cls, kwargs, p0, grads):
    p = torch.nn.Parameter(p0.clone())
    plain = "fused" in kwargs or "foreach" in kwargs or cls in (HandLion, MuonWithAdamW)
    o = cls([p], **({} if plain else {"foreach": False}), **kwargs)
    for g in grads:
        p.grad = g.clone()
        o.step()
    return p.detach()


def _lt_run(opt, p0, grads):
    params = ParamList.of_pack([p0])
    state = opt.init(params)
    for g in grads:
        state = opt.step(state, params, [g])
    return params.values()[0]


# (leantrain, torch.optim, kwargs, exact bits?): each rule's declared equivalent (the fused
# kernels where leantrain runs them; Lion: the hand-written torch optimizer of the table)
TORCH_EQUIVALENTS = [(case.opt, *case.torch(), True) for case in TABLE.values()] + [
    (optim.adam(0.01), torch.optim.Adam, dict(lr=0.01), False),  # the foreach form: to rounding
]


@pytest.mark.parametrize("opt, cls, kwargs, exact", TORCH_EQUIVALENTS, ids=lambda x: getattr(x, "__name__", None))
def test_matches_torch_optim_step_by_step(opt, cls, kwargs, exact):
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(8, 8, generator=gen)  # a matrix: Muon's own rule applies
    grads = [torch.randn(8, 8, generator=gen) for _ in range(10)]
    for n in range(1, 11):
        ours, theirs = _lt_run(opt, p0, grads[:n]), _torch_run(cls, kwargs, p0, grads[:n])
        if exact:
            assert torch.equal(ours, theirs), f"step {n}"
        else:  # Adam: our denominator folds sqrt(1-b2^t) into eps (one pass fewer)
            torch.testing.assert_close(ours, theirs, rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("name", [n for n in REGISTRY if TABLE[n].f64 is not None])
def test_matches_the_float64_reference(name):
    opt = REGISTRY[name]()
    gen = torch.Generator().manual_seed(11)
    p0 = torch.randn(32, generator=gen, dtype=torch.float64)
    grads = [torch.randn(32, generator=gen, dtype=torch.float64) for _ in range(8)]
    ours = _lt_run(opt, p0, grads)
    tol = TABLE[name].f64_rtol
    torch.testing.assert_close(ours, TABLE[name].f64(opt.hyper, p0, grads), rtol=tol, atol=tol / 10)
    ours32 = _lt_run(opt, p0.float(), [g.float() for g in grads])
    torch.testing.assert_close(ours32.double(), TABLE[name].f64(opt.hyper, p0, grads), rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------- native path
@pytest.mark.parametrize("name", NATIVE)
def test_native_equals_host_on_cpu_mirrors(name):
    opt = REGISTRY[name]()
    gen = torch.Generator().manual_seed(5)
    p0 = torch.randn(16, generator=gen)
    host, dev = ParamList.of_pack([p0]), ParamList.of_pack([p0]).to_device("cpu")
    sh, sd = opt.init(host), opt.init(dev, native=True)
    mirror_before = dev[0].storage.mirror
    for _ in range(5):
        g = torch.randn(16, generator=gen)
        sh, sd = opt.step(sh, host, [g]), opt.step_native(sd, dev, [g])
    s = dev[0].storage
    assert s.mirror is mirror_before and not s.host_current  # only the mirror was written
    assert torch.equal(dev.values()[0], p0)  # the host is stale, untouched
    assert torch.equal(dev.values_synced()[0], host.values()[0])


def test_mixing_paths_is_rejected_and_changes_nothing(unchanged):
    opt = optim.adam(0.1)
    params = ParamList.of_pack([torch.randn(4)]).to_device("cpu")
    native = opt.step_native(opt.init(params, native=True), params, [torch.ones(4)])
    with unchanged(params, native), pytest.raises(lt.OptimizerStateError, match="cannot mix generic and native"):
        opt.step(native, params, [torch.ones(4)])
    host = opt.step(opt.init(params), params, [torch.ones(4)])
    params.to_device("cpu")
    with unchanged(params, host), pytest.raises(lt.OptimizerStateError, match="cannot mix generic and native"):
        opt.step_native(host, params, [torch.ones(4)])
    fresh = opt.init(params, native=True)  # init starts a fresh history: allowed again
    opt.step_native(fresh, params, [torch.ones(4)])


def test_native_needs_mirrors_and_a_native_kind():
    params = ParamList.of_pack([torch.randn(2)])
    with pytest.raises(lt.OptimizerStateError, match=r"slot 0 has no device mirror"):
        optim.adam(0.1).init(params, native=True)
    with pytest.raises(lt.OptimizerStateError, match="rmsprop has no native path"):
        optim.rmsprop(0.1).init(params.to_device("cpu"), native=True)


def test_zero_gradient_leaves_parameter_unchanged_with_t_1():
    opt = optim.adam(0.1)
    params = ParamList.of_pack([torch.tensor([1.5, -2.0])]).to_device("cpu")
    state = opt.step_native(opt.init(params, native=True), params, [torch.zeros(2)])
    assert torch.equal(params.values_synced()[0], torch.tensor([1.5, -2.0]))
    rec = state.slots[0]
    assert rec.step == 1 and not rec.m.any() and not rec.v.any()


def test_native_retie_that_merges_histories_is_rejected(unchanged):
    opt = optim.adamw(0.1)
    p, q = Param(torch.ones(2)), Param(torch.ones(2))
    params = ParamList([p, q, q]).to_device("cpu")
    state = opt.init(params, native=True)
    for _ in range(4):
        state = opt.step_native(state, params, [torch.ones(2), torch.ones(2), torch.ones(2)])
    assert [r is not None for r in state.slots] == [True, True, False]
    assert [state.slots[i].step for i in (0, 1)] == [4, 4]
    retied = ParamList([p, p, q])  # slot 1 now aliases slot 0; both own histories
    with unchanged(retied, state), pytest.raises(lt.OptimizerStateError, match="separate optimizer histories"):
        opt.step_native(state, retied, [torch.ones(2)] * 3)


def test_generic_untie_splits_the_shared_history():
    opt = optim.sgd(0.1, momentum=0.9)
    p = Param(torch.zeros(2))
    tied = ParamList([p, p])
    state = opt.step(opt.init(tied), tied, [torch.ones(2), torch.ones(2)])
    q = Param(torch.zeros(2))
    untied = ParamList([p, q])
    state2 = opt.step(state, untied, [torch.ones(2), torch.ones(2)])
    assert state2.slots[0] is not state2.slots[1]
    assert state2.slots[0].buf.data_ptr() != state2.slots[1].buf.data_ptr()
    # each side continued the history the tie had built: b = 2*0.9 + 1
    assert state2.slots[0].buf.tolist() == state2.slots[1].buf.tolist() == pytest.approx([2.8, 2.8])


def test_other_configuration_is_rejected(unchanged):
    params = ParamList.of_pack([torch.randn(3)])
    state = optim.adam(0.1).init(params)
    with unchanged(params, state), pytest.raises(lt.OptimizerStateError, match="different optimizer configuration"):
        optim.adam(0.1, beta1=0.5).step(state, params, [torch.ones(3)])
    with unchanged(params, state), pytest.raises(lt.OptimizerStateError, match="different optimizer configuration"):
        optim.adamw(0.1).step(state, params, [torch.ones(3)])
    optim.adam(0.5).step(state, params, [torch.ones(3)])  # the lr is not part of the binding


def test_bad_gradient_packs_rejected_before_any_write(unchanged):
    opt = optim.adam(0.1)
    p = Param(torch.ones(2), name="w")
    params = ParamList([p, Param(torch.ones(3), name="b"), p])
    state = opt.step(opt.init(params), params, [torch.ones(2), torch.ones(3), torch.ones(2)])
    for grads, pattern in [
        ([torch.ones(2), torch.ones(3)], "pack length mismatch"),
        ([torch.ones(2), torch.ones(3), torch.ones(3)], r"slot 2 \('w'\): expected shape \(2,\), got \(3,\)"),
        ([torch.ones(2), torch.ones(3, dtype=torch.float64), torch.ones(2)], r"slot 1 \('b'\): expected dtype"),
        ([torch.ones(2), torch.ones(3).to_sparse(), torch.ones(2)], r"slot 1 \('b'\): got a sparse gradient, which adam does not take"),
    ]:
        with unchanged(params, state), pytest.raises(lt.LeantrainError, match=pattern):
            opt.step(state, params, grads)


# ------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: optim.sgd(-0.1), "optim.sgd: lr must be finite and >= 0, got -0.1"),
        (lambda: optim.sgd(float("nan")), "optim.sgd: lr must be finite and >= 0, got nan"),
        (lambda: optim.sgd(0.1, momentum=1.0), r"optim.sgd: momentum must be in \[0, 1\), got 1.0"),
        (lambda: optim.adagrad(0.1, eps=0.0), "optim.adagrad: eps must be finite and > 0, got 0.0"),
        (lambda: optim.rmsprop(0.1, decay=-0.1), r"optim.rmsprop: decay must be in \[0, 1\), got -0.1"),
        (lambda: optim.adam(0.1, beta1=1.0), r"optim.adam: beta1 must be in \[0, 1\), got 1.0"),
        (lambda: optim.adam(0.1, beta2=1.5), r"optim.adam: beta2 must be in \[0, 1\), got 1.5"),
        (lambda: optim.adam(0.1, eps=float("inf")), "optim.adam: eps must be finite and > 0, got inf"),
        (lambda: optim.adamw(0.1, weight_decay=-1.0), "optim.adamw: weight_decay must be finite and >= 0, got -1.0"),
        (lambda: optim.adadelta(rho=1.0), r"optim.adadelta: rho must be in \[0, 1\), got 1.0"),
        (lambda: optim.adam("0.1"), "optim.adam: lr must be a number, got '0.1'"),
    ],
)
def test_bad_hyperparameters_rejected(make, message):
    with pytest.raises(lt.ConfigError, match=f"^{message}$"):
        make()


@pytest.mark.parametrize("eps, ok", [(1e-50, False), (1e50, False), (1e-45, True)])
@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_eps_checked_after_rounding_to_float32(kind, eps, ok, unchanged):
    opt = getattr(optim, kind)(0.1, eps=eps)
    params = ParamList.of_pack([torch.ones(2)])
    if ok:
        opt.init(params)
        return
    with unchanged(params), pytest.raises(lt.ConfigError, match="after conversion to float32"):
        opt.init(params)
    opt.init(ParamList.of_pack([torch.ones(2, dtype=torch.float64)]))  # fine in float64


def test_with_lr_sets_the_rate_of_every_slot():
    state = optim.sgd(0.1).init(ParamList.of_pack([torch.ones(1), torch.ones(1)]))
    assert state.with_lr(0.5).lr == 0.5
    with pytest.raises(lt.ConfigError, match="lr must be finite and >= 0"):
        state.with_lr(-1.0)


# ---------------------------------------------------------------- schedules
def test_schedule_formulas():
    assert optim.constant(0.3).lr_at(99) == 0.3
    s = optim.step(1.0, 3, 0.5)
    assert [s.lr_at(t) for t in range(7)] == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25]
    e = optim.exponential(2.0, 0.9)
    assert e.lr_at(0) == 2.0 and e.lr_at(5) == 2.0 * 0.9**5
    w = optim.warmup_cosine(1.0, 0.1, 4, 10)
    assert [w.lr_at(t) for t in range(4)] == [1.0 * (t + 1) / 4 for t in range(4)]
    assert w.lr_at(4) == 1.0  # cos(0): the peak
    assert w.lr_at(7) == 0.1 + 0.9 * (1 + math.cos(math.pi * 3 / 6)) / 2
    assert w.lr_at(10) == 0.1 and w.lr_at(50) == 0.1


def test_warmup_cosine_edge_cases():
    assert optim.warmup_cosine(1.0, 0.2, 3, 0).lr_at(0) == 0.2  # total 0: min
    w = optim.warmup_cosine(1.0, 0.2, 10, 4)  # warm-up longer than the run
    assert [w.lr_at(t) for t in range(4)] == [(t + 1) / 4 for t in range(4)]
    assert optim.warmup_cosine(1.0, 0.2, 4, 4).lr_at(3) == 1.0
    z = optim.warmup_cosine(1.0, 0.2, 0, 4)
    assert z.lr_at(0) == 1.0 and z.lr_at(2) == 0.2 + 0.8 * (1 + math.cos(math.pi * 2 / 4)) / 2


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: optim.step(0.1, 0), "optim.step: step_size must be an integer >= 1, got 0"),
        (lambda: optim.step(0.1, 2, gamma=1.5), r"optim.step: gamma must be in \[0, 1\], got 1.5"),
        (lambda: optim.exponential(0.1, -0.1), r"optim.exponential: gamma must be in \[0, 1\], got -0.1"),
        (lambda: optim.exponential(float("inf"), 0.5), "optim.exponential: base must be finite and >= 0, got inf"),
        (lambda: optim.constant(-1.0), "optim.constant: lr must be finite and >= 0, got -1.0"),
        (lambda: optim.warmup_cosine(0.1, 0.2, 1, 5), "optim.warmup_cosine: min must be <= peak, got min=0.2 > peak=0.1"),
        (lambda: optim.warmup_cosine(0.1, 0.0, -1, 5), "optim.warmup_cosine: warmup_steps must be an integer >= 0, got -1"),
    ],
)
def test_bad_schedules_rejected(make, message):
    with pytest.raises(lt.ConfigError, match=f"^{message}$"):
        make()


@pytest.mark.parametrize("name", REGISTRY)
def test_the_fallback_forms_agree_with_the_fused_kernels(name, monkeypatch):
    """The foreach forms (another device or dtype) against the fused kernels on the same
    gradients: SGD bit for bit, the adaptive rules to rounding (their kernels fold the
    bias correction and the denominator differently)."""
    opt = REGISTRY[name]()
    h, rule = opt.hyper, rule_for(opt.hyper)
    gen = torch.Generator().manual_seed(3)
    shapes = [(3,), (2, 5), (7,)]
    fused = [torch.randn(s, generator=gen) for s in shapes]
    plain = [p.clone() for p in fused]
    recs_f, recs_p = [rule.init(h, p) for p in fused], [rule.init(h, p) for p in plain]
    for step in range(5):
        gs = [torch.randn(s, generator=gen) for s in shapes]
        recs_f = rule.update_many(h, 0.05, recs_f, fused, gs)
        with monkeypatch.context() as m:
            m.setattr(classic_rules, "fusable", lambda ps, cuda=True: False)
            recs_p = rule.update_many(h, 0.05, recs_p, plain, gs)
    for a, b in zip(fused, plain):
        if h.kind == "sgd" and h.momentum == 0.0:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
