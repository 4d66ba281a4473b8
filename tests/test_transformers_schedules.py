"""transformers' schedule names and keywords: ``optim.get_scheduler`` with every
``SchedulerType`` against ``transformers.get_scheduler`` run live, on an optimizer of two
param groups, each group's rate equal at every index (the metric-fed ones, plateau and
greedy, fed the same values); the command's twelve ``--scheduler`` names against
Trainer's own curves. Skipped cleanly without transformers."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import leantrain as lt
from leantrain import optim

transformers = pytest.importorskip("transformers")
N = 50

# type -> scheduler_specific_kwargs (transformers' defaults where it has them)
TYPES = {
    "linear": {},
    "cosine": {},
    "cosine-2-cycles": {"num_cycles": 2.0},
    "cosine_with_restarts": {},
    "cosine_with_restarts-3": {"num_cycles": 3},
    "polynomial": {"lr_end": 1e-4, "power": 2.0},
    "constant": {},
    "constant_with_warmup": {},
    "inverse_sqrt": {},
    "inverse_sqrt-timescale": {"timescale": 5},
    "reduce_lr_on_plateau": {"patience": 1, "factor": 0.5},
    "cosine_with_min_lr": {"min_lr": 1e-3},
    "cosine_with_min_lr-rate": {"min_lr_rate": 0.1, "num_cycles": 0.75},
    "cosine_warmup_with_min_lr": {"min_lr_rate": 0.05},
    "cosine_warmup_with_min_lr-warmup_lr_rate": {"min_lr": 2e-3, "warmup_lr_rate": 0.1},
    "warmup_stable_decay": {"num_decay_steps": 15, "warmup_type": "cosine", "decay_type": "1-sqrt",
                            "min_lr_ratio": 0.1},
    "warmup_stable_decay-stable": {"num_decay_steps": 10, "num_stable_steps": 20},
    "greedy": {"patience": 1, "factor": 0.8, "min_lr": 1e-3, "max_lr": 0.2, "cooldown": 1, "warmup": 1},
    "greedy-smooth": {"patience": 2, "smooth": True, "window_size": 3, "threshold_mode": "rel", "reset_start": 2,
                      "min_lr": [1e-2, 0.2]},
}
METRICS = (torch.randn(N, generator=torch.Generator().manual_seed(5)).cumsum(0) * 0.3).tolist()


def _groups():
    return [{"params": [nn.Parameter(torch.zeros(2))]}, {"params": [nn.Parameter(torch.zeros(3))], "lr": 0.3}]


@pytest.mark.parametrize("case", sorted(TYPES))
def test_every_scheduler_type_gives_transformers_rates_per_group(case):
    name, kwargs = case.split("-")[0], TYPES[case]
    torch_opt = torch.optim.AdamW(_groups(), lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.get_scheduler(name, torch_opt, num_warmup_steps=6, num_training_steps=40,
                                            scheduler_specific_kwargs=dict(kwargs))
    ours = optim.get_scheduler(name, optim.adamw(0.05).with_param_groups(_groups()), num_warmup_steps=6,
                               num_training_steps=40, scheduler_specific_kwargs=dict(kwargs))
    fed = name in ("reduce_lr_on_plateau", "greedy")
    seen = set()
    for t in range(N):
        rates = [g["lr"] for g in torch_opt.param_groups]
        assert list(ours.rates_at(t)[0]) == rates, t
        seen.add(tuple(rates))
        torch_opt.step()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if fed:
                theirs.step(METRICS[t])
                ours.observe(METRICS[t])
            else:
                theirs.step()
    assert len(seen) > 1 or name == "constant"


@pytest.mark.parametrize("make", [
    lambda k: optim.get_linear_schedule_with_warmup(0.1, num_warmup_steps=3, num_training_steps=20, last_epoch=k),
    lambda k: optim.get_cosine_schedule_with_warmup(0.1, 3, 20, num_cycles=0.25, last_epoch=k),
    lambda k: optim.get_wsd_schedule(0.1, num_warmup_steps=2, num_decay_steps=5, num_training_steps=20,
                                     last_epoch=k),
])
def test_transformers_function_names_resume_with_last_epoch(make):
    """A transformers schedule made with ``last_epoch=k - 1`` continues a run of ``k`` steps."""
    whole = make(-1)
    for k in (1, 5, 12):
        resumed = make(k - 1)
        assert [resumed.rates_at(t)[0] for t in range(6)] == [whole.rates_at(k + t)[0] for t in range(6)]


@pytest.mark.parametrize("call, message", [
    (lambda: optim.get_scheduler("sawtooth", 0.1), "not one of transformers' scheduler types"),
    (lambda: optim.get_scheduler("linear", 0.1, num_training_steps=10), "needs num_warmup_steps"),
    (lambda: optim.get_scheduler("cosine", 0.1, num_warmup_steps=1), "needs num_training_steps"),
    (lambda: optim.get_scheduler("cosine_with_min_lr", 0.1, 1, 10), "min_lr or min_lr_rate"),
    (lambda: optim.get_scheduler("cosine_with_min_lr", 0.1, 1, 10, {"min_lr": 0.0, "min_lr_rate": 0.1}), "not both"),
    (lambda: optim.get_wsd_schedule(0.1, 2, 5), "num_training_steps or num_stable_steps"),
    (lambda: optim.get_scheduler("greedy", 0.1, scheduler_specific_kwargs={"factor": 1.5}), "factor"),
    (lambda: optim.get_scheduler("polynomial", 0.1, 1, 10, {"lr_end": 0.5}), "lr_end"),
])
def test_bad_transformers_arguments_are_config_errors(call, message):
    with pytest.raises(lt.ConfigError, match=message):
        call()


def test_warmup_ratio_is_trainers_ceil_of_the_run():
    from leantrain.optim.schedules.transformers_names import warmup_steps_for

    assert warmup_steps_for("x", 1000, warmup_ratio=0.03) == math.ceil(1000 * 0.03) == 30
    assert warmup_steps_for("x", 999, 0.05) == 50 and warmup_steps_for("x", 999, 7) == 7
    with pytest.raises(lt.ConfigError, match="not both"):
        warmup_steps_for("x", 10, 3, 0.1)


@pytest.mark.parametrize("per", ["step", "epoch"])
@pytest.mark.parametrize("warmup", [{"warmup": 3}, {"warmup_ratio": 0.15}])
def test_the_commands_twelve_trainer_names_are_trainers_curves(per, warmup):
    """``--scheduler NAME`` for each of Trainer's lr_scheduler_type names: the rates of
    transformers' get_scheduler with Trainer's warm-up (``--warmup`` steps or
    ``--warmup-ratio``: ceil of the ratio of the run) over the run's indices."""
    from leantrain.cli.run_schedules import TRAINER_SCHEDULERS
    from leantrain.cli.runconfig import RunConfig

    assert len(TRAINER_SCHEDULERS) == 12 == len(transformers.trainer_utils.SchedulerType)
    steps_per_epoch, epochs = 7, 4
    total = epochs * (steps_per_epoch if per == "step" else 1)
    warm = warmup.get("warmup") or math.ceil(total * warmup["warmup_ratio"])
    for name in TRAINER_SCHEDULERS:
        args = {"cosine_with_min_lr": {"min_lr": 1e-4}, "cosine_warmup_with_min_lr": {"min_lr_rate": 0.1},
                "warmup_stable_decay": {"num_decay_steps": 1}}.get(name)
        cfg = RunConfig.build(None, {"scheduler": name, "schedule_per": per, "epochs": epochs, "lr": 0.01,
                                     "scheduler_args": args, **warmup})
        ours = cfg.make_schedule(steps_per_epoch)
        torch_opt = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=0.01)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = transformers.get_scheduler(name, torch_opt, num_warmup_steps=warm, num_training_steps=total,
                                                scheduler_specific_kwargs=dict(args or {}))
            for t in range(total):
                assert ours.rates_at(t)[0] == (torch_opt.param_groups[0]["lr"],), (name, t)
                torch_opt.step()
                if name in ("reduce_lr_on_plateau", "greedy"):
                    theirs.step(1.0)
                    ours.observe(1.0)
                else:
                    theirs.step()
