"""Every schedule against the torch or transformers scheduler it mirrors, at every index,
bit for bit: the rate torch's optimizer holds after ``t`` calls of ``scheduler.step()``
equals ``lr_at(t)``; and a loop that resumes from a checkpoint continues the same rates."""

from __future__ import annotations

import math

import pytest
import torch

import leantrain as lt
from leantrain import optim

transformers = pytest.importorskip("transformers")
N = 60


def _torch_rates(make, base: float, n: int = N) -> list[float]:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=base)
    sched = make(opt)
    rates = []
    for _ in range(n):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


def _ours(schedule, n: int = N) -> list[float]:
    return [schedule.lr_at(t) for t in range(n)]


S = torch.optim.lr_scheduler
T = transformers
CASES = {
    "linear": (optim.linear(1e-3, 7, 50), lambda o: T.get_linear_schedule_with_warmup(o, 7, 50), 1e-3),
    "linear-no-warmup": (optim.linear(0.1, 0, 40), lambda o: T.get_linear_schedule_with_warmup(o, 0, 40), 0.1),
    "cosine": (optim.cosine_with_warmup(3e-4, 5, 45), lambda o: T.get_cosine_schedule_with_warmup(o, 5, 45), 3e-4),
    "cosine-restarts-hf": (optim.cosine_with_warmup(3e-4, 5, 45, 3, restarts=True),
                           lambda o: T.get_cosine_with_hard_restarts_schedule_with_warmup(o, 5, 45, 3), 3e-4),
    "cosine-restarts-hf-default-cycles": (optim.cosine_with_warmup(3e-4, 5, 45, restarts=True),
                                          lambda o: T.get_cosine_with_hard_restarts_schedule_with_warmup(o, 5, 45),
                                          3e-4),
    "wsd": (optim.warmup_stable_decay(1e-3, 6, 20, 15, min_ratio=0.1),
            lambda o: T.get_wsd_schedule(o, 6, 15, num_stable_steps=20, min_lr_ratio=0.1), 1e-3),
    "wsd-1-sqrt": (optim.warmup_stable_decay(1e-3, 6, 20, 15, warmup_shape="cosine", decay_shape="1-sqrt"),
                   lambda o: T.get_wsd_schedule(o, 6, 15, num_stable_steps=20, warmup_type="cosine",
                                                decay_type="1-sqrt"), 1e-3),
    "polynomial": (optim.polynomial(1e-3, 4, 40, 1e-6, 2.0),
                   lambda o: T.get_polynomial_decay_schedule_with_warmup(o, 4, 40, 1e-6, 2.0), 1e-3),
    "inverse-sqrt": (optim.inverse_sqrt(1e-3, 8), lambda o: T.get_inverse_sqrt_schedule(o, 8), 1e-3),
    "inverse-sqrt-timescale": (optim.inverse_sqrt(1e-3, 8, 3), lambda o: T.get_inverse_sqrt_schedule(o, 8, 3), 1e-3),
    "one-cycle": (optim.one_cycle(0.1, N), lambda o: S.OneCycleLR(o, 0.1, N, cycle_momentum=False), 0.1),
    "one-cycle-3": (optim.one_cycle(0.1, N, 0.25, "linear", 10.0, 100.0, True),
                    lambda o: S.OneCycleLR(o, 0.1, N, pct_start=0.25, anneal_strategy="linear", div_factor=10.0,
                                           final_div_factor=100.0, three_phase=True, cycle_momentum=False), 0.1),
    "cosine-restarts": (optim.cosine_restarts(0.1, 7, 1, 1e-4),
                        lambda o: S.CosineAnnealingWarmRestarts(o, 7, 1, 1e-4), 0.1),
    "cosine-restarts-mult": (optim.cosine_restarts(0.1, 3, 2), lambda o: S.CosineAnnealingWarmRestarts(o, 3, 2), 0.1),
    "multi-step": (optim.multi_step(0.1, [5, 12, 12, 30], 0.3), lambda o: S.MultiStepLR(o, [5, 12, 12, 30], 0.3), 0.1),
    "lambda": (optim.lambda_schedule(0.1, lambda t: 0.97 ** t), lambda o: S.LambdaLR(o, lambda t: 0.97 ** t), 0.1),
    "sequential": (optim.sequential([optim.linear(0.1, 0, 10), optim.lambda_schedule(0.1, lambda t: 0.9 ** t)], [10]),
                   lambda o: S.SequentialLR(o, [S.LambdaLR(o, lambda t: max(0.0, float(10 - t) / 10.0)),
                                                S.LambdaLR(o, lambda t: 0.9 ** t)], [10]), 0.1),
}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", CASES)
def test_the_same_rates_as_torch_and_transformers_at_every_index(name):
    ours, make, base = CASES[name]
    assert _ours(ours) == _torch_rates(make, base)


@pytest.mark.filterwarnings("ignore")
def test_chained_gives_torchs_chained_scheduler_bits_with_parts_of_any_start_factor():
    """optim.chained is torch's ChainedScheduler: a LinearLR warm-up part starts at factor 0.5
    and keeps it (the old closed form divided each part by its first rate and lost it)."""
    L = optim.lr_scheduler
    ours = optim.chained([L.LinearLR(0.1, 0.5, total_iters=6), L.ExponentialLR(0.1, 0.95),
                          L.MultiStepLR(0.1, [10, 25], 0.5)])
    theirs = _torch_rates(lambda o: S.ChainedScheduler([S.LinearLR(o, 0.5, total_iters=6), S.ExponentialLR(o, 0.95),
                                                        S.MultiStepLR(o, [10, 25], 0.5)]), 0.1)
    assert theirs[0] == 0.05 and _ours(ours) == theirs


@pytest.mark.filterwarnings("ignore")
def test_exponential_is_upstreams_closed_form_and_exponential_lr_torchs_products():
    """optim.exponential keeps the spec's base * gamma**t; torch multiplies in place. The
    guide states the measured gap; lr_scheduler.ExponentialLR gives torch's bits."""
    theirs = _torch_rates(lambda o: S.ExponentialLR(o, 0.9), 0.1)
    assert _ours(optim.lr_scheduler.ExponentialLR(0.1, 0.9)) == theirs
    closed = _ours(optim.exponential(0.1, 0.9))
    ulps = [abs(a - b) / math.ulp(b) for a, b in zip(closed, theirs)]
    assert closed != theirs and max(ulps) <= 4  # measured: first differs at index 3, 3 ulps at 18, 4 at most over 60


def test_a_schedule_resumes_with_the_rates_it_would_have_had(tmp_path):
    """Killed after 4 of 8 updates and resumed: the same rates at every update, the same bits."""
    data = [(torch.randn(3, generator=torch.Generator().manual_seed(k)), torch.ones(1)) for k in range(8)]
    schedule = optim.warmup_stable_decay(0.05, 2, 2, 4)

    def run(steps, resume=None):
        torch.manual_seed(0)
        runner = lt.Runner.from_module(torch.nn.Linear(3, 1), "mse")
        rates = []
        cfg = lt.TrainConfig(steps=steps, batch_size=2, optimizer=optim.adamw(0.05), scheduler=schedule,
                             checkpoint_path=tmp_path / f"c{steps}.ckpt", checkpoint_every=1, resume_from=resume)
        lt.train_samples(runner, cfg, data, log=None, callback=lambda e: rates.append((e.step, e.state.lr)))
        return runner, rates

    whole, rates = run(8)
    run(4)
    (tmp_path / "c4.ckpt").rename(tmp_path / "c8.ckpt")
    resumed, rest = run(8, resume=tmp_path / "c8.ckpt")
    assert [s for s, _ in rest] == [5, 6, 7, 8] and rest == rates[4:]
    assert all(torch.equal(a, b) for a, b in zip(whole.module.state_dict().values(),
                                                 resumed.module.state_dict().values()))


@pytest.mark.parametrize("bad, message", [
    (lambda: optim.linear(-1.0, 1, 2), "base must be finite and >= 0"),
    (lambda: optim.polynomial(1e-3, 5, 3), "total_steps"),
    (lambda: optim.polynomial(1e-7, 0, 3, 1e-6), "end"),
    (lambda: optim.one_cycle(0.1, 0), "total_steps"),
    (lambda: optim.one_cycle(0.1, 10, anneal="exp"), "anneal"),
    (lambda: optim.multi_step(0.1, [3, -1]), "milestones"),
    (lambda: optim.sequential([optim.constant(0.1)], [3]), "milestones"),
    (lambda: optim.warmup_stable_decay(0.1, 1, 1, 1, decay_shape="exp"), "decay_shape"),
    (lambda: optim.lambda_schedule(0.1, 3), "function"),
    (lambda: optim.cosine_restarts(0.1, 0), "t_0"),
])
def test_bad_schedule_settings_are_config_errors(bad, message):
    with pytest.raises(lt.ConfigError, match=message):
        bad()


def test_a_user_function_that_gives_no_rate_is_named_at_its_index():
    with pytest.raises(lt.ConfigError, match=r"fn\(3\)"):
        optim.lambda_schedule(0.1, lambda t: -1.0 if t == 3 else 1.0).lr_at(3)
    assert math.isclose(optim.lambda_schedule(0.1, lambda t: 0.5).lr_at(0), 0.05)


@pytest.mark.parametrize("mode, threshold_mode, cooldown", [("min", "rel", 0), ("max", "abs", 2), ("min", "abs", 1)])
def test_plateau_reduces_when_torchs_reduce_lr_on_plateau_does(mode, threshold_mode, cooldown):
    gen = torch.Generator().manual_seed(4)
    values = (torch.randn(80, generator=gen).cumsum(0) * 0.1).tolist()
    ours = optim.plateau(0.1, mode=mode, factor=0.5, patience=2, threshold=0.01, threshold_mode=threshold_mode,
                         cooldown=cooldown, min_lr=1e-3)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    theirs = S.ReduceLROnPlateau(opt, mode=mode, factor=0.5, patience=2, threshold=0.01,
                                 threshold_mode=threshold_mode, cooldown=cooldown, min_lr=1e-3)
    for v in values:
        ours.observe(v)
        theirs.step(v)
        assert ours.lr_at(0) == opt.param_groups[0]["lr"]
    assert ours.lr_at(0) < 0.1  # it did reduce


def test_a_plateau_run_reads_its_evaluations_and_resumes_with_its_counters(tmp_path):
    data = [(torch.randn(3, generator=torch.Generator().manual_seed(k)), torch.ones(1)) for k in range(8)]
    evals = [(torch.randn(3, generator=torch.Generator().manual_seed(50 + k)), torch.zeros(1)) for k in range(4)]

    def run(steps, resume=None):
        torch.manual_seed(0)
        runner = lt.Runner.from_module(torch.nn.Linear(3, 1), "mse")
        rates = []
        cfg = lt.TrainConfig(steps=steps, batch_size=2, optimizer=optim.sgd(0.05),
                             scheduler=optim.plateau(0.05, patience=0, factor=0.5, threshold=0.5),
                             eval_data=evals, eval_every=1, checkpoint_path=tmp_path / f"p{steps}.ckpt",
                             checkpoint_every=1, resume_from=resume)
        lt.train_samples(runner, cfg, data, log=None, callback=lambda e: rates.append(e.state.lr))
        return runner, rates

    whole, rates = run(10)
    assert len(set(rates)) > 2  # the rate came down more than once
    run(5)
    (tmp_path / "p5.ckpt").rename(tmp_path / "p10.ckpt")
    resumed, rest = run(10, resume=tmp_path / "p10.ckpt")
    assert rest == rates[5:]
    assert all(torch.equal(a, b) for a, b in zip(whole.module.state_dict().values(),
                                                 resumed.module.state_dict().values()))


def test_a_plateau_without_evaluations_is_refused_before_training():
    runner = lt.Runner.from_module(torch.nn.Linear(3, 1), "mse")
    before = [t.clone() for t in runner.module.state_dict().values()]
    cfg = lt.TrainConfig(steps=2, batch_size=1, optimizer=optim.sgd(0.1), scheduler=optim.plateau(0.1))
    with pytest.raises(lt.ConfigError, match="plateau schedule reads evaluations"):
        lt.train_samples(runner, cfg, [(torch.ones(3), torch.ones(1))], log=None)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.module.state_dict().values()))


def test_torchs_schedulers_are_implemented_once():
    """#66: optim's constructors of torch's schedulers build the lr_scheduler classes (the
    rates above are theirs); no second class of the same schedule remains."""
    from leantrain.optim.schedules import torch_names

    L = optim.lr_scheduler
    made = {optim.one_cycle(0.1, 10): L.OneCycleLR, optim.cosine_restarts(0.1, 3): L.CosineAnnealingWarmRestarts,
            optim.multi_step(0.1, [2]): L.MultiStepLR, optim.lambda_schedule(0.1, lambda t: 1.0): L.LambdaLR}
    assert all(type(s) is cls and s.on_rate for s, cls in made.items())
    own = [v.__name__ for v in vars(torch_names).values()
           if isinstance(v, type) and issubclass(v, optim.Schedule) and v.__module__ == torch_names.__name__]
    assert own == []  # constructors only: the classes are lr_scheduler's
    assert optim.Sequential.__module__ == "leantrain.optim.schedules.upstream"  # schedules of any form, in turn
    with pytest.raises(lt.ConfigError, match="made with an optimizer"):
        optim.sequential([optim.constant(0.1), L.StepLR(optim.sgd(0.1), 3)], [4])


@pytest.mark.parametrize("name", ["OneCycleLR", "CyclicLR"])
def test_a_momentum_cycle_on_sgd_made_without_momentum_trains_as_torch(name):
    """#70: torch's default ``cycle_momentum=True`` on ``SGD(lr)`` (no momentum): torch
    writes the momentum before the first step, so its SGD keeps a buffer from there. The
    same script ported gives torch's parameters bit for bit (it was refused)."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(5, generator=g), torch.randn(2, generator=g)) for _ in range(40)]
    args = dict(max_lr=0.1, total_steps=10) if name == "OneCycleLR" else dict(base_lr=0.01, max_lr=0.1, step_size_up=3)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    sched = getattr(S, name)(opt, **args)
    for k in range(10):
        opt.zero_grad()
        for x, y in data[4 * k: 4 * k + 4]:  # the accumulation contract: item gradients summed, then 1/n
            torch.nn.functional.mse_loss(ref(x), y).backward()
        for p in ref.parameters():
            p.grad.mul_(1 / 4)
        opt.step()
        sched.step()
    ours = optim.sgd(0.1, foreach=False)  # torch's CPU default, the per-tensor loop
    cfg = lt.TrainConfig(steps=10, batch_size=4, optimizer=ours, log_every=0,
                         scheduler=getattr(optim.lr_scheduler, name)(ours, **args))
    lt.train_samples(lt.Runner.from_module(model, "mse"), cfg, data, log=None)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    assert ours.hyper.momentum == 0.0  # the user's optimizer is untouched


def test_a_momentum_cycle_on_rmsprop_made_without_momentum_is_refused_by_the_loop():
    """RMSprop's updates keep no momentum buffer without momentum, and leantrain does not
    start one: refused before training, naming the way out (SGD's case above trains)."""
    ours = optim.rmsprop(0.01)
    cfg = lt.TrainConfig(steps=2, optimizer=ours, scheduler=optim.lr_scheduler.OneCycleLR(ours, 0.1, total_steps=2))
    runner = lt.Runner.from_module(torch.nn.Linear(2, 1), "mse")
    before = [p.clone() for p in runner.module.parameters()]
    with pytest.raises(lt.ConfigError, match="cycles the momentum of a rmsprop made with momentum=0"):
        lt.train_samples(runner, cfg, [(torch.randn(2), torch.randn(1))] * 2, log=None)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.module.parameters()))


def test_a_plateau_ported_mid_run_continues_from_torchs_counters():
    """#70: ``from_torch`` of a ``ReduceLROnPlateau`` taken mid-run carries torch's best and
    bad epochs, and the loop starts from them (it reset them: 0.05 three times, then 0.025)."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = S.ReduceLROnPlateau(opt, patience=1, factor=0.5)
    for _ in range(3):
        sched.step(1.0)  # best 1.0, then two bad epochs: the rate halves to 0.05
    plan = optim.from_torch(sched)
    theirs = []
    for _ in range(4):
        theirs.append(opt.param_groups[0]["lr"])
        sched.step(1.0)  # the metric never improves
    theirs.append(opt.param_groups[0]["lr"])
    rates = []
    cfg = lt.TrainConfig(steps=5, optimizer=optim.sgd(0.05), scheduler=plan, log_every=0, eval_every=1,
                         eval_data=[(torch.zeros(2), torch.zeros(1))], eval_metrics={"flat": lambda o, t: torch.ones(())})
    plan.monitor = "flat"
    lt.train_samples(lt.Runner.from_module(torch.nn.Linear(2, 1), "mse"), cfg, [(torch.randn(2), torch.randn(1))] * 5,
                     log=None, callback=lambda e: rates.append(e.state.lr))
    assert theirs == [0.05, 0.05, 0.025, 0.025, 0.0125] and rates == theirs


def _tensor_rate_cases():
    from torch.optim import lr_scheduler as L

    return {
        "StepLR": lambda o: L.StepLR(o, 2, 0.3), "ExponentialLR": lambda o: L.ExponentialLR(o, 0.9),
        "CosineAnnealingLR": lambda o: L.CosineAnnealingLR(o, 6, 0.001),
        "SequentialLR": lambda o: L.SequentialLR(o, [L.LinearLR(o, 0.1, 1.0, 3), L.ExponentialLR(o, 0.9)], [3]),
        "ChainedScheduler": lambda o: L.ChainedScheduler([L.ConstantLR(o, 0.5, 3), L.ExponentialLR(o, 0.9)]),
        "PolynomialLR": lambda o: L.PolynomialLR(o, 5, 2.0), "LinearLR": lambda o: L.LinearLR(o, 0.2, 1.0, 4),
        "MultiStepLR": lambda o: L.MultiStepLR(o, [2, 5], 0.5), "ConstantLR": lambda o: L.ConstantLR(o, 0.5, 3),
        "LambdaLR": lambda o: L.LambdaLR(o, lambda e: 0.95 ** e),
        "MultiplicativeLR": lambda o: L.MultiplicativeLR(o, lambda e: 0.95),
        "CosineAnnealingWarmRestarts": lambda o: L.CosineAnnealingWarmRestarts(o, 3, 2, 0.001),
        "OneCycleLR": lambda o: L.OneCycleLR(o, max_lr=0.1, total_steps=14),
        "CyclicLR": lambda o: L.CyclicLR(o, 0.01, 0.1, step_size_up=3),
    }


@pytest.mark.parametrize("stepped", [0, 3])
@pytest.mark.parametrize("name", list(_tensor_rate_cases()))
def test_a_tensor_rate_is_ported_with_torchs_float32_arithmetic(name, stepped):
    """#70: an optimizer made with ``lr=torch.tensor(0.05)`` (float32): torch computes and
    fills the rate in float32; the ported schedule gives those bits at every index (it
    computed in float64 before: 6 of 8 of SequentialLR's rates differed), ported fresh or
    after 3 steps."""
    p = [torch.nn.Parameter(torch.zeros(2))]
    opt = torch.optim.SGD(p, lr=torch.tensor(0.05), momentum=0.9)
    sched = _tensor_rate_cases()[name](opt)
    for _ in range(stepped):
        opt.step()
        sched.step()
    plan = optim.from_torch(sched)
    theirs, mine = [], []
    for t in range(10):
        theirs.append(float(opt.param_groups[0]["lr"]))
        mine.append(plan.rates_at(t)[0][0])
        opt.step()
        sched.step()
    assert mine == theirs
    assert plan.rates_at(2)[0][0] == theirs[2]  # an earlier index (a resume): replayed again, the same bits
