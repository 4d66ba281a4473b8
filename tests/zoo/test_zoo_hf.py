"""Hugging Face models as they come (GPT-2 tied, Llama, a padded BERT classifier), trained
on the dicts their collators yield, against plain PyTorch doing the same on a deep copy:
gradients, steps of every optimizer family, the model's own loss, token-weighted
accumulation (``LossSum``) against the window mean computed by hand, exact resume, the
module left as it was, and weights both ways through ``save_pretrained``/``from_pretrained``."""

import copy

import pytest
import torch
import torch.nn.functional as F

import leantrain as lt
from hf_models import BY_NAME, HF_ZOO, VOCAB, model_loss, transformers
from oracle import OPTIMIZERS, assert_same_state, gradient_scale, relative_difference


def canonical(runner, grads):
    sums = lt.canonical_gradients(runner.params.canonical_slot_indices(), grads, allow_missing=True)
    return {runner.params[i].name: sums[i] for i, c in enumerate(runner.params.canonical_slot_indices()) if c == i}


@pytest.mark.parametrize("entry", HF_ZOO, ids=lambda e: e.name)
def test_mean_gradients_equal_autograd_of_the_window_mean(entry):
    model = entry.model()
    ref = copy.deepcopy(model)
    batch = entry.samples(3)
    r = lt.Runner.from_module(model, "model_mean")  # the items' mean rule: what the plain loop differentiates
    ours = canonical(r, lt.mean_gradients(r, batch))
    total = None
    for s in batch:
        loss = model_loss(ref, s)
        total = loss if total is None else total + loss
    (total * (1.0 / 3)).backward()
    theirs = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert sorted(k for k, g in ours.items() if g is not None) == sorted(theirs)
    scale = gradient_scale(theirs.values())
    for name, g in theirs.items():
        assert relative_difference(ours[name], g, scale) <= 1e-6, name


@pytest.mark.parametrize("entry", HF_ZOO, ids=lambda e: e.name)
def test_a_single_item_gradient_is_autograds(entry):
    model = entry.model()
    ref = copy.deepcopy(model)
    (sample,) = entry.samples(1)
    r = lt.Runner.from_module(model, "model_mean")
    ours = canonical(r, lt.mean_gradients(r, [sample]))
    model_loss(ref, sample).backward()
    for name, p in ref.named_parameters():
        if p.grad is None:
            continue
        if entry.tied and name == "transformer.wte.weight":  # two occurrences summed in slot order
            assert relative_difference(ours[name], p.grad) <= 1e-6
        else:
            assert torch.equal(ours[name], p.grad), name


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("entry", HF_ZOO, ids=lambda e: e.name)
def test_steps_equal_the_plain_loop(entry, opt_name):
    opt, cls, kwargs, _ = OPTIMIZERS[opt_name]
    model = entry.model()
    ref = copy.deepcopy(model)
    samples = entry.samples(4)
    r = lt.Runner.from_module(model, "model_mean")
    report = lt.train_samples(r, lt.TrainConfig(steps=4, optimizer=opt, log_every=1, measure_loss=False),
                              samples, log=lambda s: None)
    topt = cls([p for p in ref.parameters() if p.requires_grad], **kwargs)
    losses = []
    for s in samples:
        topt.zero_grad(set_to_none=True)
        loss = model_loss(ref, s)
        loss.backward()
        losses.append(loss.item())
        topt.step()
    assert_same_state(model, ref, exact=not entry.tied, rtol=1e-4)
    if not entry.tied:
        assert [v for _, v in report.losses] == losses
    if entry.tied:
        assert model.lm_head.weight is model.transformer.wte.weight  # the user's tie, kept


def _token_sum(output, sample):
    """A causal LM's summed next-token loss and the tokens it sums over."""
    logits, labels = output.logits[:, :-1], sample["labels"][:, 1:]
    total = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum")
    return lt.LossSum(total, int((labels != -100).sum()))


def _items_of(tokens):
    """One single-row item per length: ``n + 1`` real tokens, so ``n`` next-token targets."""
    g = torch.Generator().manual_seed(4)
    out = []
    for n in tokens:
        ids = torch.randint(1, VOCAB, (1, 16), generator=g)
        mask = torch.zeros_like(ids)
        mask[:, : n + 1] = 1
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def test_loss_sum_trains_on_the_window_mean_over_tokens():
    """Micro-batches of 15 and 3 tokens: the update's gradient is that of the mean over the
    window's 18 tokens (what transformers' Trainer computes with num_items_in_batch), not
    the mean of the two items' means."""
    model = BY_NAME["llama"].model()
    ref = copy.deepcopy(model)
    batch = _items_of([15, 3])
    r = lt.Runner.from_module(model, _token_sum)
    loss, grads = lt.mean_loss_and_gradients(r, batch)
    ours = canonical(r, grads)
    totals = [_token_sum(ref(**s), s) for s in batch]
    assert [t.count for t in totals] == [15, 3]
    ((totals[0].total + totals[1].total) / 18).backward()
    theirs = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    scale = gradient_scale(theirs.values())
    for name, g in theirs.items():
        assert relative_difference(ours[name], g, scale) <= 1e-6, name
    window = (totals[0].total + totals[1].total).item() / 18
    assert loss == pytest.approx(window, rel=1e-6)
    # the mean of the two items' means, which a list batch of scalar losses trains on, is
    # another update here: 3 tokens weigh as much as 15
    other = copy.deepcopy(ref)
    other.zero_grad()
    sums = [_token_sum(other(**s), s) for s in batch]
    (0.5 * (sums[0].total / 15 + sums[1].total / 3)).backward()
    item_means = {n: p.grad for n, p in other.named_parameters() if p.grad is not None}
    apart = max(relative_difference(item_means[n], g) for n, g in theirs.items())
    assert apart > 0.1, apart
    # evaluate and the loops' measurements use the same ratio
    assert lt.evaluate(r, batch)["loss"] == pytest.approx(window, rel=1e-6)
    assert r.mean_loss(batch) == pytest.approx(window, rel=1e-6)


def test_exact_resume_on_dict_batches(tmp_path):
    entry = BY_NAME["llama"]
    batches = [entry.samples(2, seed=k) for k in range(6)]

    def run(path, resume=False, epochs=2):
        r = lt.Runner.from_module(entry.model(), "model")
        cfg = lt.LoaderTrainConfig(epochs=epochs, optimizer=lt.optim.adamw(1e-3), log_every=0, checkpoint_path=path,
                                   checkpoint_every=3, resume_from=path if resume else None, measure_loss=False)
        lt.train_loader(r, cfg, batches, log=lambda s: None)
        return r

    straight = run(tmp_path / "a.ckpt")
    run(tmp_path / "b.ckpt", epochs=1)  # stops after epoch 0 (its checkpoint at update 6)
    resumed = run(tmp_path / "b.ckpt", resume=True)
    assert_same_state(resumed.module, straight.module, exact=True)


def test_the_module_stays_the_users():
    model = BY_NAME["gpt2"].model()
    params = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}
    keys = list(model.state_dict())
    r = lt.Runner.from_module(model, "model")
    lt.train_samples(r, lt.TrainConfig(steps=3, optimizer=lt.optim.adam(1e-3), log_every=0), BY_NAME["gpt2"].samples(3),
                     log=lambda s: None)
    assert {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)} == params
    assert list(model.state_dict()) == keys
    assert model.lm_head.weight is model.transformer.wte.weight


def test_weights_both_ways_through_hugging_face_folders(tmp_path):
    entry = BY_NAME["gpt2"]
    r = lt.Runner.from_module(entry.model(), "model")
    lt.train_samples(r, lt.TrainConfig(steps=3, optimizer=lt.optim.adam(1e-2), log_every=0), entry.samples(3),
                     log=lambda s: None)
    # out: a folder from_pretrained loads, the tie kept, the config with it
    lt.weights.save_weights(tmp_path / "out", r, pretrained=True)
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    assert back.lm_head.weight is back.transformer.wte.weight
    assert_same_state(back, r.module, exact=True)
    # in: save_pretrained's folder (the tied lm_head.weight left out) loads strictly
    r.module.save_pretrained(tmp_path / "hf")
    fresh = lt.Runner.from_module(entry.model(), "model")
    assert lt.weights.load_weights(tmp_path / "hf", fresh) == []
    assert_same_state(fresh.module, r.module, exact=True)
    # and a sharded one (model.safetensors.index.json and its shards)
    r.module.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    fresh = lt.Runner.from_module(entry.model(), "model")
    lt.weights.load_weights(tmp_path / "sharded", fresh)
    assert_same_state(fresh.module, r.module, exact=True)


def test_metrics_read_logits_and_ignore_the_padding():
    entry = BY_NAME["bert"]
    r = lt.Runner.from_module(entry.model(), "cross_entropy")  # the built-in loss reads .logits and labels
    data = entry.samples(4)
    res = lt.evaluate(r, data, {"accuracy": lt.metrics.accuracy})
    model = r.module.eval()
    with torch.no_grad():
        outs = [model(**s) for s in data]
    want_loss = sum(F.cross_entropy(o.logits, s["labels"]).item() for o, s in zip(outs, data)) / 4
    hits = torch.cat([(o.logits.argmax(-1) == s["labels"]).float() for o, s in zip(outs, data)])
    assert res["loss"] == pytest.approx(want_loss, rel=1e-6) and res["accuracy"] == pytest.approx(hits.mean().item())
    y = torch.tensor([1, -100, 2])
    logits = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    assert lt.metrics.accuracy({"logits": logits}, y).tolist() == [1.0, 1.0]  # the -100 row left out


@pytest.mark.parametrize("bad, error, match", [
    ("no input_ids", lt.DataError, r"item 0: Runner.loss: the model or loss rejected the sample \({attention_mask"),
    ("keys differ", lt.DataError, r"item 1: its keys differ from item 0's \(missing \['attention_mask'\]"),
    ("count 0", lt.DataError, r"item 0: .*LossSum.count must be"),
    ("count float", lt.DataError, r"item 0: .*LossSum.count must be an integer"),
])
def test_bad_structures_are_one_error_naming_the_item(bad, error, match, unchanged):
    entry = BY_NAME["llama"]
    r = lt.Runner.from_module(entry.model(), "model")
    batch = entry.samples(2)
    if bad == "no input_ids":
        batch = [{k: v for k, v in s.items() if k != "input_ids"} for s in batch]
    elif bad == "keys differ":
        del batch[1]["attention_mask"]
    else:
        count = 0 if bad == "count 0" else 3.0
        r = lt.Runner.from_module(entry.model(), lambda out, s: lt.LossSum(out.loss * 3, count))
    opt = lt.optim.adam(1e-3)
    state = opt.init(r.params)
    with unchanged(r.params, state), pytest.raises(error, match=match):
        lt.step_batch(r, opt, state, False, batch)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_leantrain_check_passes_on_hugging_face_models(name):
    """The eight guarantees on dict samples and the model's own loss (the speed limit out
    of reach of noise: no test asserts a time)."""
    entry = BY_NAME[name]
    cfg = lt.TrainConfig(steps=4, batch_size=2, optimizer=lt.optim.adamw(1e-3))
    report = lt.check(lambda: lt.Runner.from_module(entry.model(), "model"), entry.samples(8), cfg, max_ratio=100)
    assert report.passed, "\n".join(report.lines())
    assert report["host syncs"].figure.startswith("0 device-to-host reads per step")


def test_a_tensor_count_trains_as_the_same_int_count():
    """A count left on its device (a tensor, never read back: its reciprocal taken there)
    gives the bits of the same count as an int, gradients, steps and logged losses."""
    entry = BY_NAME["llama"]

    def as_int(out, s):
        t = _token_sum(out, s)
        return lt.LossSum(t.total, int(t.count))

    def as_tensor(out, s):
        t = _token_sum(out, s)
        return lt.LossSum(t.total, torch.tensor(t.count))

    batch = _items_of([15, 3, 9, 6])
    runs = []
    for loss in (as_int, as_tensor):
        r = lt.Runner.from_module(entry.model(), loss)
        report = lt.train_samples(r, lt.TrainConfig(steps=3, batch_size=2, optimizer=lt.optim.adamw(1e-3),
                                                    log_every=1, measure_loss=False), batch, log=lambda s: None)
        runs.append((r.module, report.losses))
    assert_same_state(runs[1][0], runs[0][0], exact=True)
    assert runs[0][1] == runs[1][1]
