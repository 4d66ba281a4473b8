"""Per-slot hyperparameters (``opt.per_slot(fn)``) on every zoo model against
``torch.optim`` parameter groups on a deep copy: the usual "no weight decay on biases
and norms", a smaller rate for some slots; ties, validation, checkpoints."""


import pytest
import torch

import leantrain as lt
from leantrain import optim
from oracle import assert_same_state, reference_gradients, run_both
from zoo_models import ZOO


def no_decay(p):
    return len(p.shape) < 2


def fn(p):
    out = {"weight_decay": 0.0} if no_decay(p) else {}
    if p.name and p.name.endswith("bias"):
        out["lr_scale"] = 0.5
    return out


def torch_groups(model, lr, **base):
    """The same settings as torch.optim parameter groups."""
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        key = (no_decay(p), name.endswith("bias"))
        groups.setdefault(key, []).append(p)
    out = []
    for (nd, bias), params in groups.items():
        g = {"params": params, "lr": lr * (0.5 if bias else 1.0)}
        if nd and "weight_decay" in base:
            g["weight_decay"] = 0.0
        if nd and "momentum" in base:
            g["momentum"] = 0.5
        out.append(g)
    return out


def split_groups(model, matrices: dict, vectors: dict):
    """Two torch groups: the trainable matrices with ``matrices``' options, the rest with ``vectors``'."""
    ps = [p for p in model.parameters() if p.requires_grad]
    return [g for g in ({"params": [p for p in ps if not no_decay(p)], **matrices},
                        {"params": [p for p in ps if no_decay(p)], **vectors}) if g["params"]]


CASES = {
    "adamw": (optim.adamw(0.01, 0.1).per_slot(fn), lambda m: torch.optim.AdamW(torch_groups(m, 0.01, weight_decay=0.1),
                                                                                lr=0.01, weight_decay=0.1), False),
    "sgd-momentum": (optim.sgd(0.05, 0.9).per_slot(
        lambda p: dict({"momentum": 0.5} if no_decay(p) else {}, **({"lr_scale": 0.5} if p.name and p.name.endswith("bias") else {}))),
        lambda m: torch.optim.SGD(torch_groups(m, 0.05, momentum=0.9), lr=0.05, momentum=0.9, fused=True), True),
    # a per-slot setting that gives some slots another state record, as torch's groups may
    "sgd-momentum-for-matrices": (optim.sgd(0.05).per_slot(lambda p: {} if no_decay(p) else {"momentum": 0.9}),
                                  lambda m: torch.optim.SGD(split_groups(m, {"momentum": 0.9}, {}), lr=0.05, fused=True),
                                  True),
    "adam-amsgrad-for-vectors": (optim.adam(0.01).per_slot(lambda p: {"amsgrad": True} if no_decay(p) else {}),
                                 lambda m: torch.optim.Adam(split_groups(m, {}, {"amsgrad": True}), lr=0.01, fused=True),
                                 True),
}


@pytest.mark.parametrize("mirror", [False, True], ids=["host", "mirror"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
def test_per_slot_equals_torch_parameter_groups(entry, case, mirror):
    opt, make_torch, exact = CASES[case]
    if mirror and (not opt.native or "momentum" in case):
        pytest.skip("momentum SGD has no native path")

    def groups_loop(ref, batches):
        topt = make_torch(ref)
        for batch in batches:
            reference_gradients(ref, entry.loss_fn(), batch)
            topt.step()

    both = run_both(entry, opt, lt.TrainConfig(steps=4, batch_size=2, log_every=0), mirror=mirror,
                    reference=groups_loop)
    # A module called twice (shared_twice) sums its two uses per item, then the items; the
    # reference's one backward of the items' mean sums the four contributions in autograd's
    # order: a last-bit difference these two cases' momentum carries to the weights (seen
    # on the base commit as well); every other model is compared bit for bit.
    order = entry.name == "shared_twice" and case in ("sgd-momentum-for-matrices", "adam-amsgrad-for-vectors")
    assert_same_state(both.model, both.ref, exact=exact and not entry.tied and not order, rtol=2e-5)


def gpt():
    entry = next(e for e in ZOO if e.name == "gpt")
    return entry, lt.Runner.from_module(entry.model(), entry.loss)


def test_a_tie_must_agree_with_itself(unchanged):
    entry, r = gpt()
    opt = optim.adam(0.01).per_slot(lambda p: {"lr_scale": 0.5} if p.name == "lm_head.weight" else {})
    with unchanged(r.params), pytest.raises(lt.AliasError, match="lm_head.weight.*shares its storage with.*tok_emb"):
        lt.train_samples(r, lt.TrainConfig(steps=1, optimizer=opt, log_every=0), entry.samples(2))
    agree = optim.adam(0.01).per_slot(lambda p: {"lr_scale": 0.5} if p.name in ("lm_head.weight", "tok_emb.weight") else {})
    lt.train_samples(r, lt.TrainConfig(steps=1, optimizer=agree, log_every=0), entry.samples(2))


@pytest.mark.parametrize("opt, match", [
    (optim.rprop(0.01).per_slot(lambda p: {"weight_decay": 0.1}), r"unknown hyperparameter\(s\) \['weight_decay'\]"),
    (optim.adam(0.01).per_slot(lambda p: {"lr": 0.1}), r"unknown hyperparameter\(s\) \['lr'\]"),
    (optim.adam(0.01).per_slot(lambda p: {"beta1": 1.5}), "beta1 must be in"),
    (optim.adam(0.01).per_slot(lambda p: {"eps": 1e-50}), "eps must be finite and > 0 after conversion to float32"),
    (optim.adam(0.01).per_slot(lambda p: {"lr_scale": -1.0}), "lr_scale must be >= 0"),
    (optim.adam(0.01).per_slot(lambda p: {"lr_scale": float("nan")}), "lr_scale must be a finite number"),
    (optim.adam(0.01).per_slot(lambda p: ["lr_scale"]), "returned list, expected a dict"),
    (optim.sgd(0.01).per_slot(lambda p: {"nesterov": 1}), "nesterov must be True or False"),
    (optim.adam(0.01).per_slot(lambda p: {"lr_scale": 1e300}), r"slot 0 \('pos_emb'\): lr_scale=1e\+300 makes "
     r"the rate .* not finite in float32"),
    (optim.adam(0.01).per_slot(lambda p: {"lr_scale": 1 / len(p.name.split(".")[5:])}),
     r"slot 0 \('pos_emb'\): the per-slot function raised ZeroDivisionError"),
])
def test_bad_per_slot_settings_change_nothing(unchanged, opt, match):
    entry, r = gpt()
    with unchanged(r.params), pytest.raises(lt.ConfigError, match=match):
        lt.train_samples(r, lt.TrainConfig(steps=1, optimizer=opt, log_every=0), entry.samples(2))
    with pytest.raises(lt.ConfigError, match=match):
        opt.init(r.params)


def test_per_slot_needs_a_function():
    with pytest.raises(lt.ConfigError, match="expected a function"):
        optim.adam(0.01).per_slot({"lr_scale": 1.0})


def test_checkpoints_keep_them_and_a_resume_checks_them(tmp_path, unchanged):
    entry = next(e for e in ZOO if e.name == "cnn_batchnorm")
    samples = entry.samples(6)
    opt = optim.adamw(0.01, 0.1).per_slot(fn)
    cfg = lt.TrainConfig(steps=6, batch_size=2, optimizer=opt, log_every=1, checkpoint_path=tmp_path / "a.ckpt")
    straight = lt.Runner.from_module(entry.model(), entry.loss)
    full = lt.train_samples(straight, cfg, samples, log=lambda s: None)
    first = lt.Runner.from_module(entry.model(), entry.loss)
    lt.train_samples(first, lt.TrainConfig(**{**cfg.__dict__, "checkpoint_path": tmp_path / "b.ckpt"}), samples,
                     log=lambda s: None, callback=lambda ev: ev.step == 3)
    again = lt.Runner.from_module(entry.model(seed=4), entry.loss)
    report = lt.train_samples(again, lt.TrainConfig(**{**cfg.__dict__, "resume_from": tmp_path / "b.ckpt",
                                                     "checkpoint_path": tmp_path / "c.ckpt"}), samples,
                              log=lambda s: None)
    assert report.losses == full.losses
    assert all(torch.equal(a, b) for a, b in zip(straight.params.values(), again.params.values()))
    other = lt.Runner.from_module(entry.model(seed=4), entry.loss)
    plain = lt.TrainConfig(**{**cfg.__dict__, "optimizer": optim.adamw(0.01, 0.1), "resume_from": tmp_path / "b.ckpt",
                              "checkpoint_path": None})
    with unchanged(other.params), pytest.raises(lt.CheckpointError, match="per-slot hyperparameters: checkpoint has"):
        lt.train_samples(other, plain, samples)
    state = opt.init(other.params)
    with pytest.raises(lt.OptimizerStateError, match="per-slot hyperparameters"):
        optim.adamw(0.01, 0.1).step(state, other.params, lt.mean_gradients(other, samples[:2]))
