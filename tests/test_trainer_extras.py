"""Trainer's NEFTune (``neftune_noise_alpha``) and ``label_smoothing_factor`` with a Hugging
Face model, against transformers' own hook and ``LabelSmoother`` in a hand loop (#54 item 11)."""

from __future__ import annotations

import copy

import pytest
import torch

import leantrain as lt
from leantrain import optim

transformers = pytest.importorskip("transformers")


def _gpt():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    return transformers.GPT2LMHeadModel(cfg)


def _samples(n=4):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 50, (2, 8), generator=g)
        labels = ids.clone()
        labels[:, :2] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def test_neftune_gives_the_bits_of_transformers_hook_and_is_removed_after():
    from transformers.integrations.neftune import activate_neftune, deactivate_neftune

    model, data = _gpt(), _samples()
    ref = copy.deepcopy(model)
    handle = activate_neftune(ref, 5.0)  # Trainer's own activation
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    torch.manual_seed(7)
    for s in data:
        opt.zero_grad()
        ref(**s).loss.backward()
        opt.step()
    deactivate_neftune(ref, handle)
    torch.manual_seed(7)
    runner = lt.Runner.from_module(model, "model_mean")
    lt.train_samples(runner, lt.TrainConfig(steps=4, optimizer=optim.adamw(1e-3, weight_decay=0.01), log_every=0,
                                            measure_loss=False, neftune_noise_alpha=5.0), data, log=None)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    assert not model.get_input_embeddings()._forward_hooks  # the user's module as it was
    noisy = copy.deepcopy(model)
    with pytest.raises(lt.ConfigError, match="get_input_embeddings"):
        lt.train_samples(lt.Runner.from_module(torch.nn.Linear(2, 1), "mse"),
                         lt.TrainConfig(steps=1, neftune_noise_alpha=5.0), [(torch.ones(2), torch.ones(1))])
    assert all(torch.equal(a, b) for a, b in zip(noisy.parameters(), model.parameters()))


def test_label_smoothing_is_transformers_label_smoother_on_the_shifted_labels():
    from transformers.trainer_pt_utils import LabelSmoother

    model, data = _gpt(), _samples()
    ref = copy.deepcopy(model)
    smoother = LabelSmoother(epsilon=0.1)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    torch.manual_seed(7)  # GPT-2's dropout draws alike
    for s in data:
        opt.zero_grad()
        out = ref(input_ids=s["input_ids"])  # Trainer pops the labels when it smooths
        smoother(out, s["labels"], shift_labels=True).backward()
        opt.step()
    runner = lt.Runner.from_module(model, lt.label_smoothed(model, 0.1))
    torch.manual_seed(7)
    lt.train_samples(runner, lt.TrainConfig(steps=4, optimizer=optim.adamw(1e-3, weight_decay=0.01), log_every=0,
                                            measure_loss=False), data, log=None)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    with pytest.raises(lt.ConfigError, match="epsilon"):
        lt.label_smoothed(model, 1.5)
