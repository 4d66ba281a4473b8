"""``accumulation="vectorized"``: a list batch as one stacked forward and one backward.

Items are stacked along a new leading dimension and the model sees them as one batch;
the per-item losses (the loss function mapped over the items with ``torch.vmap``) are
summed and multiplied by ``1/n`` inside the graph. Faster than the exact fold for many
small items; its sums round in the kernels' order, not left to right. Refused (before
anything changes) when the items do not stack or a layer couples them (BatchNorm in
train mode).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ...errors import ConfigError
from ..runner.runner import Runner, Sample


def check_stackable(runner: Runner, batch: Sequence[Sample]) -> None:
    """Raise unless the items stack and no layer couples them (checked before any change)."""
    op = "vectorized accumulation"
    if runner.mode == "train":
        for name, m in runner.module.named_modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                raise ConfigError(
                    f"{op}: module {name!r} ({type(m).__name__}) couples the items of a "
                    f"stacked batch in train mode; use accumulation='exact' or runner.eval()"
                )
    for i, s in enumerate(batch):
        if isinstance(s, dict) or not all(isinstance(t, torch.Tensor) for t in s):
            raise ConfigError(f"{op}: item {i}: stacks (x, y) pairs of tensors only, this sample is "
                              f"{'a dict' if isinstance(s, dict) else 'a nested pair'}; use accumulation='exact'")
    x0, y0 = batch[0]
    for i, (x, y) in enumerate(batch):
        if x.shape != x0.shape or y.shape != y0.shape:
            raise ConfigError(
                f"{op}: item {i} does not stack with item 0: x {tuple(x.shape)} vs "
                f"{tuple(x0.shape)}, y {tuple(y.shape)} vs {tuple(y0.shape)}"
            )


def stacked_loss_and_gradients(
    runner: Runner, batch: Sequence[Sample], leaves: Sequence[Optional[torch.Tensor]], scale: Optional[float] = None
) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
    """Mean loss over a stacked batch and its gradient: one forward, one backward; the
    summed per-item losses times ``scale`` (default ``1/n``)."""
    check_stackable(runner, batch)
    xs, ys = runner.inputs((torch.stack([x for x, _ in batch]), torch.stack([y for _, y in batch])))
    with runner.binding("vectorized accumulation"):
        with runner.autocast():
            per_item = torch.vmap(runner.loss_fn)(runner.module(xs), ys)
    if not isinstance(per_item, torch.Tensor):
        raise ConfigError("vectorized accumulation: the loss returned a LossSum (or another record); stacked "
                          "items take a scalar loss per item: use accumulation='exact'")
    total = per_item.sum()
    return runner.loss_gradients(total * (1.0 / len(batch) if scale is None else scale), leaves)
