"""``loss="model"`` on Hugging Face models is Trainer's objective: under accumulation the
summed token loss over the window's label tokens (counted after the shift for a causal
model, ``-100`` ignored). Reproduced against transformers' own ``Trainer`` (same data
order, SGD, constant rate, no clipping) from configs:

* GPT-2 with gradient accumulation 2: the weights agree to rounding, not to the bit
  (Trainer divides each micro-batch's summed loss by the window's count before its
  backward; leantrain sums the gradients of ``mean * count`` and multiplies by ``1/count``
  after). transformers 5's Trainer counts GPT-2's labels *before* the shift when the
  model's ``loss_type`` is unset (one token per row too many); the rows here start with
  an ignored label, where both counts agree.
* a BERT classifier, one micro-batch per update: bit for bit. With accumulation Trainer's
  update is the *sum* of the micro-batch means (this model's forward computes its own mean
  and ignores ``num_items_in_batch``, and Trainer then skips the division by the
  accumulation steps); leantrain takes the window mean (next test)."""

import copy

import pytest
import torch

import leantrain as lt
from hf_models import bert, cls_samples, gpt2, lm_samples, transformers
from oracle import relative_difference


def _rows(items):
    """The per-example dicts Trainer's collator stacks back into our items."""
    return [{k: v[r] for k, v in item.items()} for item in items for r in range(next(iter(item.values())).shape[0])]


class InOrder(transformers.Trainer if transformers is not None else object):
    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def _first_label_ignored(items):
    out = []
    for item in items:
        item = dict(item)
        item["labels"] = item["labels"].clone()
        item["labels"][:, 0] = -100
        out.append(item)
    return out


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_loss_model_trains_trainers_objective(name, tmp_path):
    torch.manual_seed(0)
    if name == "gpt2":
        model, items, accumulate = gpt2(), _first_label_ignored(lm_samples(6, lengths=[5, 9, 3, 7])), 2
    else:
        model, items, accumulate = bert(), cls_samples(3), 1
    ref, start = copy.deepcopy(model), {k: p.detach().clone() for k, p in model.named_parameters()}
    r = lt.Runner.from_module(model, "model")
    lt.train_samples(r, lt.TrainConfig(steps=3, batch_size=accumulate, optimizer=lt.optim.sgd(0.05)), items, log=None)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=accumulate,
        learning_rate=0.05, lr_scheduler_type="constant", optim="sgd", max_steps=3, max_grad_norm=0.0,
        weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
        average_tokens_across_devices=False)
    InOrder(model=ref, args=args, train_dataset=_rows(items), data_collator=transformers.default_data_collator).train()
    theirs = dict(ref.named_parameters())
    for key, p in model.named_parameters():
        if name == "bert":
            assert torch.equal(p, theirs[key]), key
        else:
            moved, moved_there = p.detach() - start[key], theirs[key].detach() - start[key]
            assert relative_difference(moved, moved_there) <= 1e-5, key  # the updates, not the weights


@pytest.mark.parametrize("build, samples", [(gpt2, lm_samples), (bert, cls_samples)], ids=["gpt2", "bert"])
def test_the_window_gradient_is_the_token_weighted_mean_and_model_mean_keeps_the_item_mean(build, samples):
    """Items with different label counts: ``"model"`` weighs each by its count,
    ``"model_mean"`` weighs them alike (the gradient differs, so the test can tell)."""
    torch.manual_seed(0)
    model = build()
    items = samples(2, lengths=[3, 10]) if samples is lm_samples else [samples(2)[0], _fewer(samples(2)[1])]
    window = lt.mean_gradients(lt.Runner.from_module(model, "model"), items)
    plain = lt.mean_gradients(lt.Runner.from_module(model, "model_mean"), items)
    singles = [lt.mean_gradients(lt.Runner.from_module(model, "model_mean"), [s]) for s in items]
    counts = [float((s["labels"][..., 1:] if samples is lm_samples else s["labels"]).ne(-100).sum()) for s in items]
    for i, g in enumerate(window):
        if g is None:
            continue
        weighted = sum(c * s[i].double() for c, s in zip(counts, singles)) / sum(counts)
        assert relative_difference(g, weighted) <= 1e-5
    assert any(g is not None and relative_difference(g, p) > 1e-3 for g, p in zip(window, plain))


def _fewer(item):
    """A classification item with one label ignored (-100): one counted example, not two."""
    item = dict(item)
    item["labels"] = item["labels"].clone()
    item["labels"][0] = -100
    return item
