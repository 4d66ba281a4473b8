"""A tiny GPT-2 the export test names as a run's ``--model`` (importable from tests/)."""

import torch
import transformers


def tiny():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    return transformers.GPT2LMHeadModel(cfg)
