"""What a sample is, how the model and the loss read it, and the losses known by name.

The rule (the same in every loop, ``evaluate`` and ``check``):

* a sample ``(x, y)`` is ``loss(model(x), y)``; ``x`` may be a tensor, a tuple of
  arguments (``model(*x)``) or a dict of keyword arguments (``model(**x)``), ``y`` any
  structure the loss reads;
* a dict sample (what Hugging Face collators yield: ``input_ids``, ``attention_mask``,
  ``labels``...) is ``model(**sample)`` and ``loss(output, sample)``;
* ``loss="model"`` takes the output's own loss (``output.loss`` or ``output["loss"]``),
  so a model given its ``labels`` computes it; on a Hugging Face model with a token loss
  it is weighted by its label tokens (``TokenWeighted``: Trainer's objective);
  ``loss="model_mean"`` takes it as it is, each item's mean weighing the same;
* the built-in losses and ``metrics.accuracy`` read ``output.logits`` (or
  ``output["logits"]``) from a model output, and for a dict sample the target
  ``sample["labels"]``; ``cross_entropy`` takes class-last logits ``(..., C)`` against
  ``(...)`` targets and ignores ``-100`` as torch's does.

Non-tensor leaves are passed through as they are; tensor leaves are moved to the
runner's device. A loss may return ``LossSum(total, count)``: a sum over ``count``
units (tokens), so that a list batch's update is the gradient of (sum of totals) /
(sum of counts) (see ``mean.py``).
"""

from __future__ import annotations

import numbers

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Union

import torch
import torch.utils._pytree as pytree
import torch.nn.functional as F

from .errors import ConfigError, DataError
from .validate import is_number

Sample = Any  # an (x, y) pair or a dict (see the module docstring)
LossFn = Callable[[Any, Any], Any]


@dataclass(frozen=True)
class LossSum:
    """A loss summed over ``count`` units (tokens, pixels): ``total`` a floating-point
    scalar tensor (the sum), ``count`` an integer >= 1 (an ``int`` or an integer scalar
    tensor). A list batch of such items is trained on (sum of totals) / (sum of counts),
    logged and evaluated as the same ratio: the mean over every unit of the window, as
    transformers' Trainer computes it with ``num_items_in_batch``."""

    total: torch.Tensor
    count: Union[int, torch.Tensor]


def logits_of(output: Any) -> Any:
    """A model output's logits (``.logits`` or ``["logits"]``), else the output itself."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and "logits" in output:
        return output["logits"]
    return getattr(output, "logits", output)


def target_of(y: Any) -> Any:
    """The target a built-in loss or metric compares with: ``y``, or ``y["labels"]`` for a
    dict sample."""
    if isinstance(y, dict):
        if "labels" not in y:
            raise DataError(f"the sample has no 'labels' (keys {sorted(map(str, y))}) for the built-in loss; "
                            f"pass labels, or train with loss='model' or a loss of your own")
        return y["labels"]
    return y


def cross_entropy(output: Any, y: Any) -> torch.Tensor:
    """torch's ``cross_entropy`` on the output's logits; class-last logits ``(..., C)``
    against ``(...)`` targets (a language model's) are flattened first where torch's
    class-first reading cannot apply; targets of ``-100`` are ignored."""
    logits, target = logits_of(output), target_of(y)
    if (logits.dim() > 2 and logits.dim() == target.dim() + 1 and logits.shape[:-1] == target.shape
            and logits.shape[:1] + logits.shape[2:] != target.shape):
        logits, target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    return F.cross_entropy(logits, target)


def mse(output: Any, y: Any) -> torch.Tensor:
    return F.mse_loss(logits_of(output), target_of(y))


def model_loss(output: Any, sample: Any) -> torch.Tensor:
    """``loss="model"``: the output's own loss (``output.loss`` or ``output["loss"]``)."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if loss is None:
        raise DataError("loss='model': the model's output has no loss (output.loss is None); give the model "
                        "its labels (a dict sample with 'labels') or pass a loss function")
    return loss


class TokenWeighted:
    """``loss="model"`` on a Hugging Face model whose loss is a mean over label tokens
    (causal and masked language models, token and single-label sequence classification):
    ``LossSum(output.loss * count, count)``, ``count`` the label tokens the loss averaged,
    counted as transformers' Trainer counts them (``labels[..., 1:]`` for a causal model's
    shifted loss, ``-100`` ignored), so that an update under accumulation and across ranks
    is the summed token loss over the window's label tokens, Trainer's objective (to
    rounding: Trainer divides each micro-batch's summed loss by the window's count)."""

    def __init__(self, shift: bool, config: Any = None) -> None:
        self.shift, self.config = shift, config

    def __call__(self, output: Any, sample: Any) -> Any:
        loss = model_loss(output, sample)
        labels = sample.get("labels") if isinstance(sample, dict) else None
        if not isinstance(labels, torch.Tensor) or not self._counts(labels):
            return loss
        counted = labels[..., 1:] if self.shift else labels
        count = counted.ne(-100).sum()  # a device tensor, never read back
        return LossSum(loss * count, count)

    def _counts(self, labels: torch.Tensor) -> bool:
        if self.config is None:
            return True
        kind = getattr(self.config, "problem_type", None)  # sequence classification: class labels only
        if kind is None:
            return getattr(self.config, "num_labels", 1) > 1 and not labels.is_floating_point()
        return kind == "single_label_classification"


TOKEN_LOSSES = {"ForCausalLMLoss": True, "ForMaskedLMLoss": False, "ForTokenClassification": False,
                "ForSequenceClassificationLoss": False}


def model_loss_of(module: Any) -> LossFn:
    """What ``loss="model"`` means for ``module``: Trainer's token-weighted objective
    (``TokenWeighted``) for a Hugging Face model with one of the token losses, else the
    output's own loss as it is (``loss="model_mean"`` asks for that everywhere)."""
    fn = getattr(type(module), "loss_function", None)
    try:
        name = getattr(module.loss_function, "__name__", "") if fn is not None else ""
    except Exception:  # a property that cannot resolve (an unknown loss type)
        name = ""
    config = getattr(module, "config", None)
    if name not in TOKEN_LOSSES or getattr(config, "is_encoder_decoder", False):
        return model_loss
    return TokenWeighted(TOKEN_LOSSES[name], config if name == "ForSequenceClassificationLoss" else None)


class LabelSmoothed:
    """Trainer's ``label_smoothing_factor`` with ``loss="model"``: transformers'
    ``LabelSmoother`` on the output's logits and the sample's ``labels`` (shifted one token
    for a causal language model, as Trainer shifts them; ``-100`` ignored): ``(1 - eps) *
    nll + eps * mean(-log_softmax)`` over the active tokens, in its order of operations.
    Like Trainer's, each item's loss is its own mean (not token-weighted across items)."""

    def __init__(self, epsilon: float, shift: bool) -> None:
        self.epsilon, self.shift = epsilon, shift

    def __call__(self, output: Any, sample: Any) -> torch.Tensor:
        labels = sample.get("labels") if isinstance(sample, dict) else None
        if not isinstance(labels, torch.Tensor):
            raise DataError("label_smoothed: the sample has no 'labels' tensor (a dict sample with 'labels')")
        logits = output["logits"] if isinstance(output, dict) else getattr(output, "logits", None)
        if logits is None:
            logits = output[0]
        if self.shift:
            logits, labels = logits[..., :-1, :].contiguous(), labels[..., 1:].contiguous()
        log_probs = -F.log_softmax(logits, dim=-1)
        if labels.dim() == log_probs.dim() - 1:
            labels = labels.unsqueeze(-1)
        padding_mask = labels.eq(-100)
        labels = torch.clamp(labels, min=0)
        nll_loss = log_probs.gather(dim=-1, index=labels)
        smoothed_loss = log_probs.sum(dim=-1, keepdim=True, dtype=torch.float32)
        nll_loss.masked_fill_(padding_mask, 0.0)
        smoothed_loss.masked_fill_(padding_mask, 0.0)
        active = padding_mask.numel() - padding_mask.long().sum()
        nll_loss = nll_loss.sum() / active
        smoothed_loss = smoothed_loss.sum() / (active * log_probs.shape[-1])
        return (1 - self.epsilon) * nll_loss + self.epsilon * smoothed_loss


def label_smoothed(module: Any, epsilon: float) -> LabelSmoothed:
    """The loss of Trainer's ``label_smoothing_factor=epsilon`` for ``module`` (a Hugging
    Face model: causal language models shift their labels)."""
    if not (is_number(epsilon) and 0 <= epsilon < 1):  # NaN fails the comparison
        raise ConfigError(f"label_smoothed: epsilon must be in [0, 1), got {epsilon!r}")
    try:
        name = getattr(getattr(module, "loss_function", None), "__name__", "")
    except Exception:  # a property that cannot resolve (an unknown loss type)
        name = ""
    return LabelSmoothed(float(epsilon), shift=name == "ForCausalLMLoss")


LOSSES: dict[str, LossFn] = {"mse": mse, "cross_entropy": cross_entropy, "model": model_loss,
                             "model_mean": model_loss}


MAX_COUNT = 2**53  # counts stay exact in the float64 their reciprocal is taken in


def checked_loss(op: str, value: object) -> Union[torch.Tensor, LossSum]:
    """What a loss returned, checked: a floating-point scalar tensor, or a ``LossSum``
    whose total is one and whose count is an integer in [1, 2**53] (``int`` or NumPy) or an
    integer scalar tensor, made int64 on the total's device so sums cannot overflow (never
    read back: a summed tensor count below 1 makes the update non-finite, which the
    step's non-finite check refuses or skips)."""
    if isinstance(value, LossSum):
        t, c = value.total, value.count
        if not (isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point()):
            raise ConfigError(f"{op}: LossSum.total must be a floating-point scalar tensor, got "
                              f"{type(t).__name__ if not isinstance(t, torch.Tensor) else (tuple(t.shape), t.dtype)}")
        if isinstance(c, torch.Tensor):
            if c.dim() != 0 or c.is_floating_point() or c.is_complex() or c.dtype == torch.bool:
                raise DataError(f"{op}: LossSum.count must be an integer (units summed), got a tensor "
                                f"{tuple(c.shape)} {c.dtype}")
            if c.device != t.device and "meta" in (c.device.type, t.device.type):
                raise DataError(f"{op}: LossSum.count is on {c.device}, its total on {t.device}: give the count "
                                f"on the total's device (or as an int)")
            # summed in int64 on the total's device: a uint8 or int16 count cannot wrap around
            return LossSum(t, c.to(device=t.device, dtype=torch.int64))
        if isinstance(c, numbers.Integral) and not isinstance(c, bool) and 1 <= int(c) <= MAX_COUNT:
            return LossSum(t, int(c))  # a NumPy integer too
        raise DataError(f"{op}: LossSum.count must be an integer in [1, 2**53] (the units the total sums), "
                        f"got {c!r}")
    if not isinstance(value, torch.Tensor) or value.dim() != 0 or not value.is_floating_point():
        got = (type(value).__name__ if not isinstance(value, torch.Tensor) else
               f"shape {tuple(value.shape)}" if value.dim() != 0 else f"dtype {value.dtype}")
        raise ConfigError(f"{op}: the loss must be a floating-point scalar tensor (or a LossSum), got {got}")
    return value


def add_losses(a, b):
    """``a + b`` for scalar losses; totals and counts added for ``LossSum``s."""
    if isinstance(a, LossSum) != isinstance(b, LossSum):
        raise DataError("a list batch mixes LossSum items with plain scalar losses: one loss, one kind")
    if isinstance(a, LossSum):
        return LossSum(a.total + b.total, a.count + b.count)
    return a + b


def check_sample(op: str, sample: object, index: int = 0) -> Sample:
    """A sample is an ``(x, y)`` pair or a dict with string keys, holding a tensor somewhere
    (a mapping, such as a ``BatchEncoding``, is read as a dict)."""
    if isinstance(sample, Mapping) and not isinstance(sample, dict):
        sample = dict(sample)
    if isinstance(sample, dict):
        if not sample or not all(isinstance(k, str) for k in sample):
            raise DataError(f"{op}: item {index}: a dict sample needs string keys (the model's keyword "
                              f"arguments), got {sorted(map(repr, sample))[:5]}")
        if not _has_tensor(sample):
            raise DataError(f"{op}: item {index}: the dict sample holds no tensor (keys {sorted(sample)})")
        return sample
    if isinstance(sample, (tuple, list)) and len(sample) == 2 and _has_tensor(sample[0]):
        return sample[0], sample[1]
    got = type(sample).__name__
    if isinstance(sample, (tuple, list)):
        got += f" of {len(sample)}: " + ", ".join(type(t).__name__ for t in sample)
    raise DataError(f"{op}: item {index}: expected an (x, y) pair (x holding a tensor) or a dict of the "
                      f"model's inputs, got {got}")


def check_alike(op: str, batch: list) -> None:
    """The items of a batch have one structure: all pairs, or all dicts with the same keys."""
    first = batch[0]
    for i, s in enumerate(batch[1:], start=1):
        if isinstance(first, dict) != isinstance(s, dict):
            raise DataError(f"{op}: item {i} is {'a dict' if isinstance(s, dict) else 'an (x, y) pair'}, item 0 "
                            f"is {'a dict' if isinstance(first, dict) else 'an (x, y) pair'}: one batch, one kind")
        if isinstance(s, dict) and s.keys() != first.keys():
            missing, extra = sorted(first.keys() - s.keys()), sorted(s.keys() - first.keys())
            raise DataError(f"{op}: item {i}: its keys differ from item 0's (missing {missing}, extra {extra})")


# Samples are walked as torch's pytrees (torch.utils._pytree): every container torch's own
# utilities take (dicts, lists, tuples, namedtuples, OrderedDicts, dataclasses and Hugging
# Face outputs registered as pytree nodes) comes back as the type the user built.
def _has_tensor(x: object) -> bool:
    if isinstance(x, torch.Tensor):
        return True  # the usual input: no walk
    return any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(x))


def to_device(x: Any, device: torch.device) -> Any:
    """``x`` with every tensor leaf on ``device`` (a copy only where one is elsewhere), in
    its own containers."""
    if isinstance(x, torch.Tensor):
        return x if x.device == device else x.to(device)
    if type(x) is tuple and all(type(t) is torch.Tensor and t.device == device for t in x):
        return x  # the usual sample, already in place (immutable: nothing to copy): no pytree walk
    return pytree.tree_map_only(torch.Tensor, lambda t: t if t.device == device else t.to(device), x)


def call_model(module: torch.nn.Module, sample: Sample) -> Any:
    """The model on a (device-placed) sample: ``module(x)``, ``module(*x)`` (a tuple or
    list ``x``, a namedtuple too), ``module(**x)`` or, for a dict sample,
    ``module(**sample)``; containers inside reach the model as built."""
    if isinstance(sample, dict):
        return module(**sample)
    x = sample[0]
    if isinstance(x, dict):
        return module(**x)
    if isinstance(x, (tuple, list)):
        return module(*x)
    return module(x)


def loss_target(sample: Sample) -> Any:
    """What the loss is given besides the output: ``y``, or the whole dict sample."""
    return sample if isinstance(sample, dict) else sample[1]


def describe(sample: Sample) -> str:
    """Shapes and dtypes of a sample's tensor leaves, for error messages."""
    def one(x) -> str:
        if isinstance(x, torch.Tensor):
            return f"{tuple(x.shape)} {x.dtype}"
        if isinstance(x, Mapping):
            return "{" + ", ".join(f"{k}: {one(v)}" for k, v in x.items()) + "}"
        if isinstance(x, (tuple, list)):
            return "(" + ", ".join(one(v) for v in x) + ")"
        return type(x).__name__

    if isinstance(sample, dict):
        return one(sample)
    return f"x {one(sample[0])}, y {one(sample[1])}"


def split_rows(sample: Sample, pieces: int) -> list:
    """A collated sample cut into at most ``pieces`` samples along dimension 0 of every
    tensor leaf that has one (they must agree on its size, the rows); 0-dim tensors and
    non-tensor leaves go to every piece as they are. The pieces are views, in row order,
    sized as ``torch.tensor_split`` sizes them (the first ``rows % pieces`` one row
    longer); fewer rows than ``pieces`` give one piece per row. With a ``LossSum`` loss
    the pieces train on exactly the uncut sample's token mean; a plain mean loss becomes
    the mean of the pieces' means."""
    if isinstance(pieces, bool) or not isinstance(pieces, int) or pieces < 1:
        raise ConfigError(f"split_rows: pieces must be an integer >= 1, got {pieces!r}")
    sizes: dict[str, int] = {}
    _rows(sample, "sample", sizes)
    if not sizes:
        raise DataError("split_rows: the sample has no tensor with a dimension to cut along")
    if len(set(sizes.values())) > 1:
        shown = ", ".join(f"{k}: {n}" for k, n in sizes.items())
        raise DataError(f"split_rows: the tensor leaves disagree on their rows (dimension 0): {shown}")
    rows = next(iter(sizes.values()))
    if rows == 0:
        raise DataError("split_rows: the sample has 0 rows")
    count = min(pieces, rows)
    base, extra = divmod(rows, count)
    out, start = [], 0
    for p in range(count):
        n = base + (p < extra)
        out.append(_cut(sample, start, n))
        start += n
    return out


def _rows(x: Any, path: str, sizes: dict) -> None:
    for where, leaf in pytree.tree_flatten_with_path(x)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            sizes[path + pytree.keystr(where)] = leaf.shape[0]


def _cut(x: Any, start: int, n: int) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: t.narrow(0, start, n) if t.dim() > 0 else t, x)
