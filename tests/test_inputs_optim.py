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
