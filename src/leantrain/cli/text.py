"""The ``text-gpt`` preset of ``leantrain train``: a small character-level GPT (its
output head tied to its token embedding, a causal mask buffer) on a text corpus shipped
with the package (``datasets/python_docs.txt``, the Python documentation's docstrings:
see ``PYTHON_DOCS_LICENSE.txt``). Samples are dicts (``input_ids``, ``labels``) of
``SEQ`` characters; the loss is the model's token-summed ``LossSum``, so logged losses,
the test loss and the perplexity are means over tokens.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..samples import LossSum

CORPUS = Path(__file__).parent / "datasets" / "python_docs.txt"
VOCAB, SEQ, WIDTH, HEADS, LAYERS = 128, 64, 64, 4, 2
TEST_FRACTION = 0.1


def text_split() -> tuple[list[dict], list[dict]]:
    """(train, test) lists of ``{"input_ids": (SEQ,), "labels": (SEQ,)}`` chunks of the
    corpus's characters (ASCII codes); the last tenth of the text is the test split."""
    codes = torch.tensor(list(CORPUS.read_bytes()), dtype=torch.long).clamp_(max=VOCAB - 1)
    chunks = [codes[i: i + SEQ] for i in range(0, len(codes) - SEQ + 1, SEQ)]
    cut = len(chunks) - max(1, int(len(chunks) * TEST_FRACTION))
    samples = [{"input_ids": c, "labels": c} for c in chunks]
    return samples[:cut], samples[cut:]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # h: (B, T, WIDTH)
        a = self.ln1(h)
        h = h + self.attn(a, a, a, attn_mask=mask, need_weights=False)[0]
        return h + self.mlp(self.ln2(h))


class TextGPT(nn.Module):
    """Token and position embeddings, ``LAYERS`` pre-norm blocks, the head tied to the
    token embedding; ``forward(input_ids, attention_mask=None, labels=None)`` returns
    ``{"logits", "loss"}``, the loss a ``LossSum`` over the next-token targets."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.register_buffer("causal", torch.triu(torch.full((SEQ, SEQ), float("-inf")), 1))
        for m in self.modules():  # GPT-2's initialisation: small weights, a loss near log(VOCAB) at the start
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, attention_mask=None, labels=None) -> dict:
        t = input_ids.shape[-1]
        h = self.tok(input_ids) + self.pos(torch.arange(t, device=input_ids.device))
        for block in self.blocks:
            h = block(h, self.causal[:t, :t])
        logits = self.head(self.ln(h))  # (B, T, VOCAB)
        out = {"logits": logits}
        if labels is not None:
            targets = labels[..., 1:]
            if attention_mask is not None:
                targets = targets.masked_fill(attention_mask[..., 1:] == 0, -100)
            total = F.cross_entropy(logits[..., :-1, :].reshape(-1, VOCAB), targets.reshape(-1), reduction="sum",
                                    ignore_index=-100)
            out["loss"] = LossSum(total, (targets != -100).sum())  # a tensor count: never read back on a device
        return out


def perplexity(mean_token_loss: float) -> float:
    """``exp`` of a mean per-token loss (``inf`` past float range)."""
    return math.exp(mean_token_loss) if mean_token_loss < 700 else float("inf")


def samples_through(steps: int, n: int, batch_size: int, accumulate: int) -> int:
    """Samples a loader run of ``steps`` updates has read: ``n`` per whole epoch, then
    ``accumulate`` batches of ``batch_size`` per update of the last one."""
    per_epoch = -(-(-(-n // batch_size)) // accumulate)  # updates per epoch
    full, rest = divmod(steps, per_epoch)
    return full * n + min(n, rest * accumulate * batch_size)


def tokens_of(samples: list) -> int:
    """The tokens of dict samples: their attention masks' ones, else their ids."""
    total = 0
    for s in samples:
        mask = s.get("attention_mask")
        total += int(mask.sum()) if mask is not None else s["input_ids"].numel()
    return total
