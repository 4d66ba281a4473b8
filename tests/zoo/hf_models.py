"""Hugging Face models built from their configs (nothing downloaded), as users bring them:
GPT-2 with its tied head, Llama (grouped-query attention, rotary embeddings, untied),
and a BERT classifier on padded batches. Their samples are the dicts HF collators yield."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

transformers = __import__("pytest").importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB, WIDTH, SEQ = 64, 32, 16


def gpt2(dropout: float = 0.0) -> torch.nn.Module:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=WIDTH, n_head=2, vocab_size=VOCAB, n_positions=32,
                                  resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=32, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def bert() -> torch.nn.Module:
    cfg = transformers.BertConfig(hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, vocab_size=VOCAB, num_labels=3, max_position_embeddings=32,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(cfg)


def lm_samples(n: int, seed: int = 0, lengths=None) -> list[dict]:
    """Causal-LM dicts: right-padded token ids, their mask, labels with -100 on the padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        ids = torch.randint(1, VOCAB, (2, SEQ), generator=g)
        mask = torch.ones_like(ids)
        if lengths is not None:
            mask[:, lengths[k % len(lengths)]:] = 0
        else:
            mask[1, SEQ - 3 - k % 4:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def cls_samples(n: int, seed: int = 0) -> list[dict]:
    """Sequence-classification dicts on padded batches (one class label per sequence)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        ids = torch.randint(1, VOCAB, (2, SEQ), generator=g)
        mask = torch.ones_like(ids)
        mask[1, SEQ - 5 - k % 3:] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (2,), generator=g)})
    return out


@dataclass(frozen=True)
class HFEntry:
    name: str
    build: Callable[[], torch.nn.Module]
    samples: Callable[..., list]
    tied: bool

    def model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return self.build()


HF_ZOO = [
    HFEntry("gpt2", gpt2, lm_samples, True),
    HFEntry("llama", llama, lm_samples, False),
    HFEntry("bert", bert, cls_samples, False),
]
BY_NAME = {e.name: e for e in HF_ZOO}


def model_loss(model: torch.nn.Module, sample: dict) -> torch.Tensor:
    """What a plain PyTorch loop computes: the model's own loss on the dict."""
    return model(**sample).loss
