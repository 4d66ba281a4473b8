"""Bad input to the optimizers (constructors, ``init``, ``step``, ``step_native``) and the
schedules: one table, then gradients a step cannot take."""

import pytest
import torch

import leantrain as lt
from leantrain import optim
from inputs_table import native_params, check_row, g2, g3, ids

OPTIMIZERS = [
    ("step pack length", lambda c: c.opt.step_native(c.state, c.params, [g3]), lt.PackError, "pack length mismatch"),
    ("step grad shape", lambda c: c.opt.step_native(c.state, c.params, [g3, g3, None, g3]), lt.PackError, r"slot 1 \('b'\): expected shape"),
    ("step grad dtype", lambda c: c.opt.step_native(c.state, c.params, [g3, g2.double(), None, g3]), lt.PackError, "expected dtype"),
    ("step sparse grad", lambda c: c.opt.step_native(c.state, c.params, [g3, g2.to_sparse(), None, g3]), lt.PackError, r"slot 1 \('b'\): got a sparse gradient, which adam does not take"),
    ("step other config", lambda c: optim.adam(0.1, beta1=0.5).step_native(c.state, c.params, [g3, g2, None, g3]), lt.OptimizerStateError, "different optimizer configuration"),
    ("step other kind", lambda c: optim.sgd(0.1).step_native(c.state, c.params, [g3, g2, None, g3]), lt.OptimizerStateError, "different optimizer configuration"),
    ("mix paths", lambda c: c.opt.step(c.state, c.params, [g3, g2, None, g3]), lt.OptimizerStateError, "cannot mix generic and native"),
    ("state not a state", lambda c: c.opt.step({}, c.params, [g3, g2, None, g3]), lt.OptimizerStateError, "expected an OptState, got dict"),
    ("sgd lr < 0", lambda c: optim.sgd(-1.0), lt.ConfigError, "lr must be finite and >= 0, got -1.0"),
    ("adam beta1 = 1", lambda c: optim.adam(0.1, beta1=1.0), lt.ConfigError, r"beta1 must be in \[0, 1\)"),
    ("adam eps = 0", lambda c: optim.adam(0.1, eps=0.0), lt.ConfigError, "eps must be finite and > 0"),
    ("adamw wd nan", lambda c: optim.adamw(0.1, weight_decay=float("nan")), lt.ConfigError, "weight_decay must be finite"),
    ("eps rounds to 0", lambda c: optim.adam(0.1, eps=1e-50).init(c.params), lt.ConfigError, "after conversion to float32"),
    ("schedule step 0", lambda c: optim.step(0.1, 0), lt.ConfigError, "step_size must be an integer >= 1"),
    ("schedule min > peak", lambda c: optim.warmup_cosine(0.1, 0.2, 1, 10), lt.ConfigError, "min must be <= peak"),
    ("schedule gamma > 1", lambda c: optim.exponential(0.1, 1.5), lt.ConfigError, r"gamma must be in \[0, 1\]"),
    ("with_lr < 0", lambda c: c.state.with_lr(-0.5), lt.ConfigError, "lr must be finite and >= 0"),
    # a plateau schedule inside a composition would never be fed evaluations (torch refuses it too)
    ("plateau in sequential", lambda c: optim.sequential([optim.plateau(0.1), optim.constant(0.1)], [2]),
     lt.ConfigError, r"schedules\[0\] is a plateau schedule"),
    ("plateau in chained", lambda c: optim.chained([optim.lr_scheduler.StepLR(0.1, 2), optim.plateau(0.1)]),
     lt.ConfigError, r"schedulers\[1\] is a plateau scheduler"),
]


@pytest.mark.parametrize("name, call, error, pattern", OPTIMIZERS, ids=ids(OPTIMIZERS))
def test_optimizers_rejects_and_changes_nothing(name, call, error, pattern, tmp_path):
    check_row(call, error, pattern, tmp_path)


def test_meta_and_sparse_gradients_are_refused_by_a_step(unchanged):
    """Meta tensors hold no data; sparse gradients are for the rules that take them
    (SGD, Adagrad), not Adam."""
    params = native_params()
    opt = optim.adam(0.1)
    state = opt.init(params, native=True)
    with unchanged(params, state), pytest.raises(lt.PackError, match=r"got a sparse gradient, which adam does not take"):
        opt.step_native(state, params, [torch.ones(3), torch.ones(2).to_sparse()])
    with unchanged(params, state), pytest.raises(lt.PackError, match="meta tensor"):
        opt.step_native(state, params, [torch.empty(3, device="meta"), torch.ones(2)])


@pytest.mark.parametrize("opt", [optim.adagrad(0.1, weight_decay=0.1),
                                 optim.adagrad(0.1).per_slot(lambda p: {"weight_decay": 0.1} if p.name == "0.weight"
                                                             else {})])
def test_adagrad_with_weight_decay_refuses_a_sparse_gradient_before_any_slot_moves(opt):
    """torch.optim.Adagrad refuses weight decay with sparse gradients; leantrain says so
    naming the slot, before the dense slots are updated (they used to be, then torch raised)."""
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Flatten(0), torch.nn.Linear(8, 2))
    r = lt.Runner.from_module(model, "mse")
    before = [p.detach().clone() for p in model.parameters()]
    cfg = lt.TrainConfig(steps=1, optimizer=opt, log_every=0, measure_loss=False)
    with pytest.raises(lt.PackError, match=r"slot 0 \('0.weight'\): got a sparse gradient, which adagrad does not "
                                           r"take with weight_decay"):
        lt.train_samples(r, cfg, [(torch.tensor([1, 2]), torch.zeros(2))])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
