"""Plain PyTorch doing what leantrain's contract says, on an untouched deep copy.

The reference step (spec §7.1, README "Buffers"): in train mode every item's forward
first advances the buffers, with no gradient; the random generators are then put back,
so each item's gradient forward draws the same numbers as its buffer forward; every
item is differentiated against those advanced buffers (restored before each item);
the losses are added left to right and the sum is multiplied by ``1/n``; one
``torch.optim`` step follows. For a single-item batch this is exactly the loop a user
writes (``loss.backward(); opt.step()``), and the zoo checks that too.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Callable, Optional, Union

import torch
from torch import nn

import leantrain as lt
from optimizer_table import TABLE

# (leantrain optimizer, torch.optim class, kwargs, equal bit for bit on equal gradients):
# every case of the shared table, against the rule's declared torch.optim equivalent
OPTIMIZERS = {name: (case.opt, *case.torch(), True) for name, case in TABLE.items()}


def _set_buffer(model: nn.Module, name: str, value: torch.Tensor) -> None:
    prefix, _, attr = name.rpartition(".")
    setattr(model.get_submodule(prefix) if prefix else model, attr, value)


def reference_gradients(model: nn.Module, loss_fn, batch) -> None:
    """Set every trainable parameter's ``.grad`` to the contract's mean gradient."""
    rng = torch.get_rng_state()
    with torch.no_grad():
        for x, _ in batch:
            model(x)  # the buffer pass
    torch.set_rng_state(rng)
    own = dict(model.named_buffers())
    advanced = {k: b.clone() for k, b in own.items()}
    model.zero_grad(set_to_none=True)
    total = None
    for x, y in batch:
        for k, b in advanced.items():  # every item sees the advanced buffers
            _set_buffer(model, k, b.clone())
        loss = loss_fn(model(x), y)
        total = loss if total is None else total + loss
    (total * (1.0 / len(batch))).backward()  # one backward of the mean
    with torch.no_grad():
        for k, b in own.items():
            b.copy_(advanced[k])
            _set_buffer(model, k, b)


def reference_steps(model: nn.Module, loss_fn, batches, opt_name: str) -> None:
    _, cls, kwargs, _ = OPTIMIZERS[opt_name]
    opt = cls([p for p in model.parameters() if p.requires_grad], **kwargs)
    for batch in batches:
        reference_gradients(model, loss_fn, batch)
        opt.step()


def plain_loop(model: nn.Module, loss_fn, samples, opt_name: str) -> None:
    """What a user writes: one forward and backward per step, then ``opt.step()``."""
    _, cls, kwargs, _ = OPTIMIZERS[opt_name]
    opt = cls([p for p in model.parameters() if p.requires_grad], **kwargs)
    for x, y in samples:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()


def module_fingerprint(model: nn.Module) -> dict:
    """What must not change about a module: its objects, ties and keys."""
    named = list(model.named_parameters(remove_duplicate=False))
    return {
        "objects": [(n, id(p)) for n, p in named],
        "buffers": [(n, id(b)) for n, b in model.named_buffers(remove_duplicate=False)],
        "names": [n for n, _ in model.named_parameters()],
        "keys": list(model.state_dict().keys()),
        "ties": sorted(
            (a, b) for i, (a, p) in enumerate(named) for b, q in named[i + 1:] if p is q
        ),
        "types": [(n, type(p).__name__, p.requires_grad) for n, p in named],
    }


def relative_difference(a: torch.Tensor, b: torch.Tensor, scale: float = 0.0) -> float:
    """``|a - b| / max(|b|, scale)`` in float64 (norms; 0 when both are zero).

    ``scale`` (the norm of the whole gradient) keeps a tensor whose true value is 0,
    such as a bias in front of BatchNorm, from dividing rounding noise by noise."""
    a, b = a.double(), b.double()
    denom = max(b.norm().item(), scale)
    diff = (a - b).norm().item()
    return diff if denom == 0 else diff / denom


def gradient_scale(grads) -> float:
    """The norm of a whole gradient pack (float64)."""
    return float(sum(g.double().norm().item() ** 2 for g in grads) ** 0.5)


def assert_same_state(model: nn.Module, ref: nn.Module, *, exact: bool, rtol: float = 1e-5) -> None:
    """Every ``state_dict`` entry equal (bit for bit, or within ``rtol`` relative)."""
    ours, theirs = model.state_dict(), ref.state_dict()
    assert list(ours) == list(theirs)
    for k in ours:
        a, b = ours[k], theirs[k]
        if exact or not a.is_floating_point():
            assert torch.equal(a, b), f"{k}: differs (max {((a - b).abs().max() if a.is_floating_point() else '')})"
        else:
            assert relative_difference(a, b) <= rtol, f"{k}: relative difference {relative_difference(a, b):.3g}"


@dataclass
class Both:
    """What ``run_both`` ran: the module leantrain trained (with its runner and report),
    and the deep copy the reference trained."""

    model: nn.Module
    ref: nn.Module
    runner: lt.Runner
    report: lt.TrainReport
    samples: list


def run_both(entry, opt: Union[str, lt.optim.Optimizer], cfg: lt.TrainConfig, *, mirror: bool = False, n: int = 4,
             seed: int = 5, reference: Optional[Callable[[nn.Module, list], None]] = None) -> Both:
    """The zoo's differential setup, written once: ``entry``'s model and an untouched deep
    copy; ``train_samples`` with ``cfg`` and optimizer ``opt`` (a name of the shared table,
    or an optimizer) on ``n`` items, on the host or (``mirror``) a CPU mirror; then, from
    the same generator state, ``reference(ref, batches)`` on the copy, where ``batches``
    are the ones the loop took (cyclic, ``cfg.batch_size`` items each). The default
    reference is the contract's mean gradient and one ``torch.optim`` step per batch,
    with the table's torch optimizer for ``opt``. Asserts the module's objects, ties and
    keys are unchanged; comparing the states is the caller's."""
    model = entry.model()
    ref = copy.deepcopy(model)
    samples = entry.samples(n)
    runner = lt.Runner.from_module(model, entry.loss)
    if mirror:
        runner.to("cpu")
    before = module_fingerprint(model)
    cfg = replace(cfg, optimizer=OPTIMIZERS[opt][0] if isinstance(opt, str) else opt)
    torch.manual_seed(seed)
    report = lt.train_samples(runner, cfg, samples, log=lambda line: None)
    k = cfg.batch_size
    batches = [[samples[(s * k + j) % n] for j in range(k)] for s in range(report.steps)]
    torch.manual_seed(seed)
    if reference is None:
        if not isinstance(opt, str):
            raise TypeError("run_both: give a reference for an optimizer outside the table")
        reference_steps(ref, entry.loss_fn(), batches, opt)
    else:
        reference(ref, batches)
    assert module_fingerprint(model) == before
    return Both(model, ref, runner, report, samples)
