"""Ready collate functions for ``DataLoader(collate=...)`` and the command's ``collate``.

``pad_tokens`` pads token sequences of different lengths into one dict item, the
shape Hugging Face collators give: ``input_ids`` (B, T) right-padded with 0,
``attention_mask`` (1 on real tokens), and ``labels`` (the ids, -100 on the padding,
which ``cross_entropy`` and the models' own losses ignore). ``padding(pad_id, ...)``
makes one with other values. ``stack`` stacks single rows (``(x, y)`` pairs or dicts of
tensors of one shape) into one minibatch item; ``items`` keeps every row its own item (what
a loader without a collate does, said on purpose: no hint at the point of use).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .errors import DataError

__all__ = ["pad_tokens", "padding", "stack", "items", "single_row", "IGNORE_INDEX"]

IGNORE_INDEX = -100


def padding(pad_id: int = 0, label_pad: int = IGNORE_INDEX) -> Callable[[Sequence], dict]:
    """A collate that pads token sequences (1-D integer tensors, or dicts holding
    ``input_ids`` and perhaps ``labels``) into one dict of (B, T_max) tensors."""

    def collate(samples: Sequence) -> dict:
        if not samples:
            raise DataError("pad_tokens: no samples to collate")
        ids, labels = [], []
        for i, s in enumerate(samples):
            x = s.get("input_ids") if isinstance(s, dict) else s
            if not (isinstance(x, torch.Tensor) and x.dim() == 1 and not x.is_floating_point()):
                raise DataError(f"pad_tokens: sample {i}: expected a 1-D integer tensor of token ids (or a dict "
                                f"with 'input_ids'), got {type(x).__name__}"
                                + (f" {tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else ""))
            y = s.get("labels", x) if isinstance(s, dict) else x
            if not (isinstance(y, torch.Tensor) and y.shape == x.shape):
                raise DataError(f"pad_tokens: sample {i}: its labels must be a tensor shaped like its input_ids")
            ids.append(x), labels.append(y)
        width = max(len(x) for x in ids)
        out_ids = torch.full((len(ids), width), pad_id, dtype=ids[0].dtype)
        out_labels = torch.full((len(ids), width), label_pad, dtype=labels[0].dtype)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for k, (x, y) in enumerate(zip(ids, labels)):
            out_ids[k, : len(x)], out_labels[k, : len(y)], mask[k, : len(x)] = x, y, 1
        return {"input_ids": out_ids, "attention_mask": mask, "labels": out_labels}

    return collate


pad_tokens = padding()
pad_tokens.__doc__ = "Pad token sequences with 0, labels with -100 (see ``padding``)."


def stack(samples: Sequence):
    """One minibatch item from single rows: ``(x, y)`` pairs (each part stacked along a new
    first dimension: ``(X, Y)``) or dicts of tensors (each key stacked): what torch's
    ``default_collate`` makes of equal-shaped rows, as one item of the list batch."""
    if not samples:
        raise DataError("stack: no samples to collate")
    first = samples[0]
    try:
        if isinstance(first, dict):
            return {k: torch.stack([s[k] for s in samples]) for k in first}
        if isinstance(first, (tuple, list)):
            return tuple(torch.stack([s[j] for s in samples]) for j in range(len(first)))
        return torch.stack(list(samples))
    except (RuntimeError, TypeError, KeyError, IndexError) as e:
        raise DataError(f"stack: the rows cannot be stacked into one minibatch (rows of one shape and kind: "
                        f"{str(e).splitlines()[0]}); pad_tokens pads sequences of different lengths") from None


def items(samples: Sequence) -> list:
    """Every row its own item of the list batch, differentiated alone (the accumulation
    contract): a loader without a collate, said on purpose."""
    return list(samples)


def single_row(sample) -> bool:
    """Whether ``sample`` looks like one row rather than a minibatch: an ``(x, ...)`` pair
    whose input is a tensor of at most one dimension, or a dict whose tensors all are."""
    if isinstance(sample, dict):
        tensors = [v for v in sample.values() if isinstance(v, torch.Tensor)]
        return bool(tensors) and all(t.dim() <= 1 for t in tensors)
    if isinstance(sample, (tuple, list)) and sample:
        return isinstance(sample[0], torch.Tensor) and sample[0].dim() <= 1
    return False
