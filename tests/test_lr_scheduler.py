"""torch's schedulers by their own names (``leantrain.optim.lr_scheduler``) against torch's
scheduler objects run live: every class of ``torch.optim.lr_scheduler`` and
``swa_utils.SWALR``, on an optimizer of two param groups (torch's own test fixture: a
second group at another rate), with momentum (SGD) and first-beta (Adam) cycling, each
group's rate and momentum equal to torch's at every index, bit for bit; ported torch
objects (``from_torch``) at the step they stand; resumed schedulers; a loop that trains
with a cycling schedule against the hand loop; bad arguments refused."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.optim import swa_utils

import leantrain as lt
from leantrain import optim
from leantrain.optim import lr_scheduler as L

S = torch.optim.lr_scheduler
N = 40


class _Swa:
    """``swa_utils.SWALR`` under the name the table uses for both modules."""

    SWALR = staticmethod(lambda *a, **k: swa_utils.SWALR(*a, **k))


# name -> (function of (module, optimizer) building the scheduler). ``m`` is torch's
# lr_scheduler module or leantrain's; the arguments are the ones torch's own
# test_lrscheduler.py uses where it has them.
CASES = {
    "StepLR": lambda m, o: m.StepLR(o, gamma=0.1, step_size=3),
    "MultiStepLR": lambda m, o: m.MultiStepLR(o, gamma=0.1, milestones=[2, 5, 9]),
    "MultiStepLR-repeated": lambda m, o: m.MultiStepLR(o, gamma=0.5, milestones=[3, 3, 8]),
    "ConstantLR": lambda m, o: m.ConstantLR(o, factor=1.0 / 2, total_iters=5),
    "LinearLR": lambda m, o: m.LinearLR(o, start_factor=1.0 / 4, end_factor=3.0 / 5, total_iters=4),
    "ExponentialLR": lambda m, o: m.ExponentialLR(o, gamma=0.9),
    "PolynomialLR": lambda m, o: m.PolynomialLR(o, total_iters=4, power=0.9),
    "LambdaLR-per-group": lambda m, o: m.LambdaLR(o, lr_lambda=[lambda e: 0.95 ** e, lambda e: 1 / (e + 1)]),
    "MultiplicativeLR": lambda m, o: m.MultiplicativeLR(o, lr_lambda=lambda e: 0.95),
    "CosineAnnealingLR-past-T_max": lambda m, o: m.CosineAnnealingLR(o, T_max=10, eta_min=1e-10),
    "CosineAnnealingWarmRestarts": lambda m, o: m.CosineAnnealingWarmRestarts(o, T_0=10, T_mult=1, eta_min=1e-10),
    "CosineAnnealingWarmRestarts-mult": lambda m, o: m.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2, eta_min=1e-4),
    "CyclicLR-triangular": lambda m, o: m.CyclicLR(o, base_lr=0.01, max_lr=[0.1, 1.0], step_size_up=4),
    "CyclicLR-triangular2": lambda m, o: m.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=4, step_size_down=3,
                                                   mode="triangular2", base_momentum=0.7, max_momentum=[0.9, 0.95]),
    "CyclicLR-exp_range": lambda m, o: m.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=4, mode="exp_range",
                                                 gamma=0.9),
    "CyclicLR-scale_fn": lambda m, o: m.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=5,
                                                scale_fn=lambda x: 1 / (x + 1), scale_mode="iterations",
                                                cycle_momentum=False),
    "OneCycleLR": lambda m, o: m.OneCycleLR(o, max_lr=[0.1, 1.0], total_steps=N),
    "OneCycleLR-linear-3-phase": lambda m, o: m.OneCycleLR(o, max_lr=25.0, final_div_factor=2.0, base_momentum=0.5,
                                                          max_momentum=0.9, total_steps=N, anneal_strategy="linear",
                                                          three_phase=True),
    "OneCycleLR-epochs": lambda m, o: m.OneCycleLR(o, max_lr=0.1, epochs=4, steps_per_epoch=10, pct_start=0.25),
    "SWALR-cos": lambda m, o: (_Swa if m is S else m).SWALR(o, swa_lr=0.01, anneal_epochs=5),
    "SWALR-linear-0": lambda m, o: (_Swa if m is S else m).SWALR(o, swa_lr=[0.01, 0.02], anneal_epochs=0,
                                                                anneal_strategy="linear"),
    "SequentialLR": lambda m, o: m.SequentialLR(o, [m.LinearLR(o, 0.1, total_iters=5), m.ExponentialLR(o, 0.9),
                                                    m.CosineAnnealingLR(o, 7)], milestones=[5, 15]),
    "SequentialLR-warmup-cosine": lambda m, o: m.SequentialLR(o, [m.ConstantLR(o, factor=0.1, total_iters=2),
                                                                  m.ExponentialLR(o, gamma=0.9)], milestones=[2]),
    "ChainedScheduler": lambda m, o: m.ChainedScheduler([m.ConstantLR(o, 0.5, 4), m.ExponentialLR(o, 0.9),
                                                         m.CosineAnnealingLR(o, 7)]),
    "ChainedScheduler-of-sequential": lambda m, o: m.ChainedScheduler([
        m.SequentialLR(o, [m.LinearLR(o, 0.2, total_iters=3), m.StepLR(o, 4)], milestones=[3]),
        m.ExponentialLR(o, 0.97)], o),
    "ChainedScheduler-cyclic-momentum": lambda m, o: m.ChainedScheduler([
        m.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=3), m.ExponentialLR(o, 0.95)]),
}

# torch's optimizer on the path whose bits leantrain's equal (fused, float32), and leantrain's
KINDS = {
    "sgd": (lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, fused=True),
            lambda: optim.sgd(0.05, momentum=0.9)),
    "adam": (lambda groups: torch.optim.Adam(groups, lr=0.05, fused=True), lambda: optim.adam(0.05)),
}


def _groups():
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))
    return [{"params": [a]}, {"params": [b], "lr": 0.5}]


def _state(opt) -> tuple:
    return ([g["lr"] for g in opt.param_groups],
            [g["momentum"] if "momentum" in g else g["betas"][0] for g in opt.param_groups])


def _torch_run(case: str, kind: str, n: int = N):
    opt = KINDS[kind][0](_groups())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = CASES[case](S, opt)
        out = []
        for _ in range(n):
            out.append(_state(opt))
            opt.step()
            sched.step()
    return out


def _ours(plan, n: int = N, start: int = 0) -> list:
    out = []
    for t in range(start, start + n):
        lrs, momenta = plan.rates_at(t)
        out.append((list(lrs), None if momenta is None else list(momenta)))
    return out


def _leantrain_optimizer(kind: str):
    return KINDS[kind][1]().with_param_groups(_groups())


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_torch_scheduler_gives_torchs_rates_and_momenta_at_every_index(case, kind):
    plan = CASES[case](L, _leantrain_optimizer(kind))
    theirs = _torch_run(case, kind)
    ours = _ours(plan)
    assert [lrs for lrs, _ in ours] == [lrs for lrs, _ in theirs]
    if plan.cycles_momentum():
        assert [m for _, m in ours] == [m for _, m in theirs]
        assert len({tuple(m) for _, m in theirs}) > 2  # torch did cycle it
    else:
        assert all(m is None for _, m in ours)
        assert all(m == theirs[0][1] for _, m in theirs)  # ... and torch did not


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("taken", [0, 7])
def test_a_torch_scheduler_object_ports_at_the_step_it_stands(case, kind, taken):
    """``from_torch(scheduler)``: index 0 is the rate torch's optimizer holds now, every
    later index the rate after as many more ``step()`` calls."""
    opt = KINDS[kind][0](_groups())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = CASES[case](S, opt)
        for _ in range(taken):
            opt.step()
            sched.step()
        plan = optim.from_torch(sched)
        for t in range(20):
            lrs, momenta = plan.rates_at(t)
            assert list(lrs) == _state(opt)[0], t
            if momenta is not None:
                assert list(momenta) == _state(opt)[1], t
            opt.step()
            sched.step()


@pytest.mark.parametrize("resume_at", [0, 4, 11])
def test_a_scheduler_made_with_last_epoch_continues_as_torchs_resumed_one(resume_at):
    """torch resumes a run of ``k`` steps with ``last_epoch=k - 1`` (its construction steps
    once more) on an optimizer whose groups hold ``initial_lr`` and the run's rate;
    leantrain's made alike continues from the same index."""
    opt = torch.optim.SGD(_groups(), lr=0.05)
    first = S.CosineAnnealingLR(opt, T_max=9)
    for _ in range(resume_at):
        opt.step()
        first.step()
    resumed = S.CosineAnnealingLR(opt, T_max=9, last_epoch=resume_at - 1)  # after construction: resume_at
    ours = L.CosineAnnealingLR([0.05, 0.5], T_max=9, last_epoch=resume_at - 1)
    for t in range(15):
        assert list(ours.rates_at(t)[0]) == [g["lr"] for g in opt.param_groups]
        opt.step()
        resumed.step()


def test_rates_asked_out_of_order_are_the_rates_in_order():
    """A resumed loop asks an earlier index after a later one: the replay starts over."""
    plan = L.CyclicLR(_leantrain_optimizer("sgd"), 0.01, 0.1, step_size_up=3)
    forward = _ours(plan, 12)
    assert [_ours(plan, 1, t)[0] for t in (9, 2, 11, 0, 5)] == [forward[t] for t in (9, 2, 11, 0, 5)]


@pytest.mark.parametrize("mode, min_lr", [("min", 1e-3), ("max", [1e-3, 0.2])])
def test_reduce_lr_on_plateau_by_torchs_name_cuts_each_group_as_torch(mode, min_lr):
    values = (torch.randn(60, generator=torch.Generator().manual_seed(3)).cumsum(0) * 0.1).tolist()
    opt = torch.optim.SGD(_groups(), lr=0.05)
    theirs = S.ReduceLROnPlateau(opt, mode=mode, factor=0.5, patience=2, min_lr=min_lr)
    ours = L.ReduceLROnPlateau(_leantrain_optimizer("sgd"), mode=mode, factor=0.5, patience=2, min_lr=min_lr)
    for v in values:
        ours.observe(v)
        theirs.step(v)
        assert list(ours.rates_at(0)[0]) == [g["lr"] for g in opt.param_groups]
    assert ours.rates_at(0)[0][1] < 0.5


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


@pytest.mark.parametrize("kind, make", [
    ("sgd", lambda m, o: m.OneCycleLR(o, max_lr=[0.1, 0.05], total_steps=8)),
    ("adam", lambda m, o: m.CyclicLR(o, base_lr=1e-3, max_lr=[1e-2, 5e-3], step_size_up=3)),
    ("sgd", lambda m, o: m.SequentialLR(o, [m.LinearLR(o, 0.2, total_iters=3), m.CosineAnnealingLR(o, 5)], [3])),
])
def test_a_loop_trains_with_torchs_rates_and_momenta_as_the_hand_loop(kind, make):
    """train_samples with a cycling schedule on two param groups: the hand loop's bits
    (torch's optimizer stepping, then its scheduler, per update)."""
    model = _net()
    ref = copy.deepcopy(model)
    data = [(torch.randn(3, generator=torch.Generator().manual_seed(k)), torch.randn(1)) for k in range(8)]

    def groups(m):
        return [{"params": [m[0].weight, m[0].bias]}, {"params": [m[2].weight, m[2].bias], "lr": 0.5}]

    torch_opt = KINDS[kind][0](groups(ref))
    theirs = make(S, torch_opt)
    opt = KINDS[kind][1]().with_param_groups(groups(model))
    runner = lt.Runner.from_module(model, "mse")
    lt.train_samples(runner, lt.TrainConfig(steps=8, batch_size=1, optimizer=opt, scheduler=make(L, opt),
                                            log_every=0, measure_loss=False), data, log=None)
    for x, y in data:
        torch_opt.zero_grad()
        nn.functional.mse_loss(ref(x.unsqueeze(0)), y.unsqueeze(0)).backward()
        torch_opt.step()
        theirs.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("bad, message", [
    (lambda o: L.StepLR(o, step_size=0), "step_size"),
    (lambda o: L.MultiStepLR(o, milestones=[2, -1]), "milestones"),
    (lambda o: L.LambdaLR(o, lr_lambda=[lambda e: 1.0]), "one value per param group"),
    (lambda o: L.LinearLR(o, start_factor=0.0), "start_factor"),
    (lambda o: L.CosineAnnealingLR(o, T_max=0), "T_max"),
    (lambda o: L.CosineAnnealingWarmRestarts(o, T_0=5, T_mult=0), "T_mult"),
    (lambda o: L.CyclicLR(o, 0.01, 0.1, mode="sawtooth"), "mode"),
    (lambda o: L.CyclicLR(0.05, 0.01, 0.1), "cycle_momentum=True"),
    (lambda o: L.CyclicLR(optim.adagrad(0.05), 0.01, 0.1), "cycle_momentum=True"),
    (lambda o: L.OneCycleLR(o, 0.1), "total_steps"),
    (lambda o: L.OneCycleLR(o, 0.1, total_steps=10, anneal_strategy="exp"), "anneal_strategy"),
    (lambda o: L.SWALR(o, swa_lr=-1.0), "swa_lr"),
    (lambda o: L.SequentialLR(o, [L.StepLR(o, 2)], milestones=[3]), "milestones"),
    (lambda o: L.SequentialLR(o, [L.StepLR(o, 2), L.ReduceLROnPlateau(o)], milestones=[3]), "plateau"),
    (lambda o: L.ChainedScheduler([L.ReduceLROnPlateau(o)]), "plateau"),
    (lambda o: L.ChainedScheduler([L.StepLR(o, 2), L.StepLR(0.1, 2)]), "param group"),
    (lambda o: L.ChainedScheduler([optim.linear(0.1, 2, 9)]), "torch-named"),
    (lambda o: L.ReduceLROnPlateau(o, min_lr=[0.0]), "one value per param group"),
    (lambda o: optim.sequential([L.StepLR(o, 2), L.StepLR(o, 3)], [4]), "SequentialLR"),
])
def test_bad_scheduler_arguments_are_config_errors(bad, message):
    with pytest.raises(lt.ConfigError, match=message):
        bad(_leantrain_optimizer("sgd"))


def test_one_cycle_past_its_end_is_refused_as_torch_refuses_it():
    plan = L.OneCycleLR(0.1, 0.1, total_steps=5, cycle_momentum=False)
    assert plan.rates_at(5)[0]
    with pytest.raises(lt.ConfigError, match="past total_steps=5"):
        plan.rates_at(6)


@pytest.mark.parametrize("make, message", [
    (lambda opt: L.StepLR(0.1, 3), "1 param group"),
    (lambda opt: L.OneCycleLR(optim.adam(0.1).with_param_groups(_groups()), 0.1, total_steps=8), "cycles the betas"),
])
def test_a_scheduler_made_for_another_optimizer_is_refused_before_training(make, message):
    model = _net()
    before = [p.detach().clone() for p in model.parameters()]
    opt = optim.sgd(0.05, momentum=0.9).with_param_groups(
        [{"params": [model[0].weight, model[0].bias]}, {"params": [model[2].weight, model[2].bias]}])
    runner = lt.Runner.from_module(model, "mse")
    data = [(torch.randn(3), torch.randn(1)) for _ in range(2)]
    with pytest.raises(lt.ConfigError, match=message):
        lt.train_samples(runner, lt.TrainConfig(steps=2, optimizer=opt, scheduler=make(opt), log_every=0), data,
                         log=None)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_torch_scheduler_stepped_with_an_epoch_is_refused_by_the_port():
    opt = torch.optim.SGD(_groups(), lr=0.05)
    sched = S.StepLR(opt, 2)
    for g in opt.param_groups:
        g["lr"] *= 3  # set by hand: no replay of StepLR gives it
    with pytest.raises(lt.ConfigError, match="set by hand"):
        optim.from_torch(sched)
