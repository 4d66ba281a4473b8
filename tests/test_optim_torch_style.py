"""What a torch user hands leantrain: torch's keyword names, a module, an iterable of
Parameters, param groups, an existing torch optimizer (``from_torch``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import leantrain as lt
from leantrain import optim
from leantrain.optim.constructors import CONSTRUCTORS, TORCH_NAMES


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _grads(model, x):
    for p in model.parameters():
        p.grad = None
    model(x).pow(2).mean().backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("name", sorted(TORCH_NAMES))
def test_a_torch_kwargs_dict_ports_unchanged(name):
    """The defaults of every torch optimizer's group, passed to leantrain's constructor."""
    p = nn.Parameter(torch.zeros(2, 2))
    torch_opt = getattr(torch.optim, name)([p])
    kwargs = {k: v for k, v in torch_opt.param_groups[0].items() if k not in ("params", "param_names", "initial_lr")}
    opt = CONSTRUCTORS[TORCH_NAMES[name]](**kwargs)
    assert opt.kind == TORCH_NAMES[name] and opt.lr == kwargs["lr"]


@pytest.mark.parametrize("kind", sorted(CONSTRUCTORS))
@pytest.mark.parametrize("bad, message", [
    ({"bogus": 1}, "unknown argument 'bogus'"),
    ({"capturable": True}, "capturable=True is not supported"),
    ({"differentiable": True}, "differentiable=True is not supported"),
    ({"lr": -1.0}, "lr must be finite and >= 0"),
    ({"lr": torch.tensor([1e-3, 1e-3])}, "1 element"),
])
def test_what_leantrain_does_not_run_is_a_config_error_naming_the_argument(kind, bad, message):
    with pytest.raises(lt.ConfigError, match=message) as e:
        CONSTRUCTORS[kind](**bad)
    assert f"optim.{kind}" in str(e.value)


@pytest.mark.parametrize("make, message", [
    (lambda: optim.adam(betas=(1.0, 0.9)), "beta1 must be in"),
    (lambda: optim.adam(betas=(0.9, torch.tensor(0.99))), "betas must be numbers"),
    (lambda: optim.sgd(0.1, momentum=0.9, dampening=0.5, nesterov=True), "nesterov needs"),
    (lambda: optim.rprop(etas=(1.5, 0.5)), "etaminus"),
    (lambda: optim.muon(adjust_lr_fn="arbitrary"), "adjust_lr_fn"),
    (lambda: optim.rmsprop(0.1, decay=0.9, alpha=0.8), "name the same setting"),
    (lambda: optim.adamw(decoupled_weight_decay=False), "decoupled"),
    (lambda: optim.sgd(0.1, momentum=0.9, numerics="torchlean", nesterov=True), "numerics='torchlean'"),
])
def test_torch_s_error_cases_are_config_errors(make, message):
    with pytest.raises(lt.ConfigError, match=message):
        make()


def test_init_takes_a_module_parameters_or_param_groups_and_updates_the_users_tensors():
    model = _model()
    x = torch.randn(5, 4)
    ref = copy.deepcopy(model)
    groups = [{"params": list(model[0].parameters()), "weight_decay": 0.0},
              {"params": list(model[2].parameters()), "lr": 1e-4}]
    ref_groups = [{"params": list(ref[0].parameters()), "weight_decay": 0.0},
                  {"params": list(ref[2].parameters()), "lr": 1e-4}]
    theirs = torch.optim.AdamW(ref_groups, lr=1e-3, fused=True)
    opt = optim.adamw(1e-3)
    state = opt.init(groups)
    weight = model[0].weight
    for _ in range(3):
        state = opt.step(state, groups, _grads(model, x))
        _grads(ref, x)
        theirs.step()
    assert model[0].weight is weight  # the user's Parameter, updated in place
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    for target in (model, model.parameters(), list(model.named_parameters())):
        assert opt.init(target).steps == 0


def test_with_param_groups_gives_a_loop_the_groups_settings():
    model = _model()
    groups = [{"params": [model[0].weight], "lr": 0.0}, {"params": [model[0].bias, *model[2].parameters()]}]
    opt = optim.sgd(0.1).with_param_groups(groups)
    runner = lt.Runner.from_module(model, "mse")
    frozen = model[0].weight.detach().clone()
    cfg = lt.TrainConfig(steps=3, batch_size=2, optimizer=opt)
    lt.train_samples(runner, cfg, [(torch.randn(4), torch.randn(1)) for _ in range(4)], log=None)
    assert torch.equal(model[0].weight.detach(), frozen)  # its group's rate is 0
    assert not torch.equal(model[2].weight.detach(), _model()[2].weight.detach())


@pytest.mark.parametrize("name, groups, kwargs", [
    # every option torch's param groups take, flags and a state record of another layout included
    ("AdamW", [{"weight_decay": 0.1, "lr": 3e-3}, {"weight_decay": 0.0, "amsgrad": True, "lr": 1e-4}],
     dict(lr=1e-3, betas=(0.9, 0.95), fused=True)),
    ("Adam", [{"maximize": True}, {"decoupled_weight_decay": True, "weight_decay": 0.1, "lr": 0.01}],
     dict(lr=1e-3, fused=True)),
    ("SGD", [{"momentum": 0.9, "nesterov": True, "lr": 0.1}, {"momentum": 0.0, "lr": 0.01}],
     dict(lr=0.03, fused=True)),
    ("RMSprop", [{"centered": True}, {"momentum": 0.5, "lr": 0.003}], dict(lr=1e-3, foreach=True)),
])
def test_param_groups_with_every_torch_option_give_torchs_bits(name, groups, kwargs):
    """Each group keeps its own rate exactly (0.01, not 0.03 * (0.01 / 0.03)) and takes
    flags (amsgrad, maximize, nesterov, decoupled_weight_decay, centered), also ones that
    change a slot's state record, as torch's groups do."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    mine = [dict(g, params=list(m.parameters())) for g, m in zip(groups, (model[0], model[2]))]
    theirs = getattr(torch.optim, name)([dict(g, params=list(m.parameters())) for g, m in zip(groups, (ref[0], ref[2]))],
                                        **kwargs)
    opt, state = optim.from_torch(getattr(torch.optim, name)(mine, **kwargs))
    x = torch.randn(6, 4)
    for _ in range(4):
        state = opt.step(state, list(model.parameters()), _grads(model, x))
        _grads(ref, x)
        theirs.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    again = getattr(optim, opt.kind)(**{k: v for k, v in kwargs.items()}).with_param_groups(
        [dict(g, params=list(m.parameters())) for g, m in zip(theirs.param_groups, (model[0], model[2]))])
    assert again.group_lrs == tuple(g["lr"] for g in theirs.param_groups)  # torch's filled groups port unchanged


def test_nanogpt_configure_optimizers_groups_port_unchanged():
    """nanoGPT's ``configure_optimizers``: decay for matrices, none for vectors, AdamW
    fused; its groups (as torch fills them: every default, flags included) through
    ``with_param_groups`` train with torch's bits."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 16))
    ref = copy.deepcopy(model)

    def configure(m):
        params = {n: p for n, p in m.named_parameters() if p.requires_grad}
        decay = [p for p in params.values() if p.dim() >= 2]
        nodecay = [p for p in params.values() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": nodecay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), fused=True)

    theirs = configure(ref)
    opt = optim.adamw(6e-4).with_param_groups(configure(model).param_groups)
    runner = lt.Runner.from_module(model, "cross_entropy")
    data = [(torch.randint(0, 16, (4,)), torch.randint(0, 16, (4,))) for _ in range(3)]
    lt.train_samples(runner, lt.TrainConfig(steps=3, optimizer=opt, log_every=0, measure_loss=False), data, log=None)
    for x, y in data:
        theirs.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        theirs.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("bad, message", [
    (lambda m: torch.zeros(2), "single Tensor"),
    (lambda m: [{"params": [m[0].weight]}, {"params": [m[0].weight]}], "more than once"),
    (lambda m: [m[0].weight, {"params": [m[0].bias]}], "mixes param groups"),
    (lambda m: [("w", m[0].weight), m[0].bias], "mixes named"),
    (lambda m: [], "empty"),
    (lambda m: [{"lr": 0.1}], "no 'params'"),
    (lambda m: [{"params": [m[0].weight], "lr": -0.1}, {"params": [m[0].bias]}], r"param group 0: lr must be"),
    (lambda m: [{"params": [m[0].weight]}, {"params": []}], "param group 1 has no parameters"),
    (lambda m: [{"params": [m[0].weight], "amsgrad": 1}, {"params": [m[0].bias]}], "amsgrad must be True or False"),
])
def test_bad_params_are_config_errors_that_change_nothing(bad, message):
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(lt.ConfigError, match=message):
        optim.adamw(1e-3).init(bad(model))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("name, kwargs", [
    ("AdamW", dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)),
    ("Adam", dict(lr=1e-2, amsgrad=True, fused=True)),
    ("SGD", dict(lr=1e-2, momentum=0.9, dampening=0.1, fused=True)),
    ("Adagrad", dict(lr=1e-2, lr_decay=0.01, fused=True)),
    ("RMSprop", dict(lr=1e-3, momentum=0.5, centered=True, foreach=True)),
    ("NAdam", dict(lr=1e-2, foreach=True)),
    ("RAdam", dict(lr=1e-2, foreach=True)),
    ("Adamax", dict(lr=1e-2, foreach=True)),
    ("ASGD", dict(lr=1e-2, t0=2, foreach=True)),
    ("Rprop", dict(lr=1e-2, foreach=True)),
    ("Adafactor", dict(lr=1e-2, foreach=True)),
    ("Adadelta", dict(lr=1.0, weight_decay=0.1, foreach=True)),
])
def test_a_run_started_in_torch_continues_here_with_torchs_bits(name, kwargs):
    model = _model()
    xs = [torch.randn(5, 4, generator=torch.Generator().manual_seed(k)) for k in range(6)]
    groups = lambda m: [{"params": list(m[0].parameters())}, {"params": list(m[2].parameters()), "lr": 5e-3}]
    theirs = getattr(torch.optim, name)(groups(model), **kwargs)
    for x in xs[:3]:
        _grads(model, x)
        theirs.step()
    ref = copy.deepcopy(model)
    ref_opt = getattr(torch.optim, name)(groups(ref), **kwargs)
    ref_opt.load_state_dict(theirs.state_dict())
    opt, state = optim.from_torch(theirs, model)
    for x in xs[3:]:
        state = opt.step(state, model, _grads(model, x))
        _grads(ref, x)
        ref_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
