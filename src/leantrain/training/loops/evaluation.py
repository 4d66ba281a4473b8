"""``evaluate``: the mean loss and named metrics of a runner on held-out data; the loops'
named evaluation sets; ``predict``: the model's outputs per item.

Runs in eval mode with no gradients and no buffer updates, restores the runner's mode
and leaves the random generators as found (a torch DataLoader's too). The loss is the
mean over the examples, as Trainer and Lightning report it: each item's loss weighs the
rows of its target (a short last batch weighs less; items of one size give upstream's mean
of the items' losses, bit for bit; a ``LossSum`` loss its total over its count; an empty
set gives 0.0, reported with ``items == 0``, upstream's rule); a metric is averaged over every example when it returns one value per
example, over items when it returns one value per item.
"""

from __future__ import annotations

import itertools
from contextlib import nullcontext
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Union

import torch
import torch.utils._pytree as pytree

from ...data import DataLoader, Dataset
from ...errors import ConfigError, DataError, LeantrainError
from ...validate import check_choice
from .batches import loader_generators, loader_samples
from ..runner.binding import MODEL_ERRORS, rng_preserved
from ..runner.runner import Runner, Sample, check_sample
from ...samples import LossSum, add_losses, call_model, checked_loss, describe, loss_target

Metric = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
EvalData = Union[list, Dataset, DataLoader, Iterable]


def eval_items(op: str, data: EvalData, limit=None) -> Iterator[Sample]:
    """The items of ``data``, read lazily: a sample list, a Dataset, a DataLoader or an
    iterable of batches (a collated ``(x, y)`` batch is one item). Nothing is kept: memory
    does not grow with the data. ``limit``: at most that many of its batches (an integer)
    or that fraction of them (a float in (0, 1], of a set with a length), Lightning's
    ``limit_val_batches``: a loader's batches, a sample list's samples (each its own)."""
    if isinstance(data, Dataset):
        data = data.to_list()
    count = batch_count(op, data, limit, "limit_eval_batches")
    if isinstance(data, (list, tuple)):
        return (check_sample(op, s, i) for i, s in enumerate(data if count is None else data[:count]))
    if isinstance(data, DataLoader):
        return loader_samples(op, data) if count is None else iter(data.iter_items(op, count))
    if isinstance(data, Iterable):
        return loader_samples(op, data if count is None else itertools.islice(data, count))
    raise ConfigError(f"{op}: expected a sample list, a Dataset or a loader, got {type(data).__name__}")


def batch_count(op: str, data, limit, name: str) -> Optional[int]:
    """How many batches of ``data`` a ``limit`` reads (``None``: all): an integer as it is,
    a fraction of ``len(data)`` rounded down (Lightning's rule), refused when ``data`` has
    no length or the fraction gives no batch."""
    if limit is None or (isinstance(limit, float) and limit == 1.0):
        return None
    if isinstance(limit, int):
        return limit
    try:
        n = len(data)
    except TypeError:
        raise ConfigError(f"{op}: {name}={limit} is a fraction of the batches, but the data has no length: give "
                          f"a number of batches") from None
    count = int(n * limit)
    if count < 1:
        raise ConfigError(f"{op}: {name}={limit} of {n} batches is no batch: give a larger fraction, or a number")
    return count


def check_limit(op: str, name: str, value) -> None:
    """A ``limit_*_batches`` setting: ``None``, a count >= 1, or a fraction in (0, 1]."""
    ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1) or (
        isinstance(value, float) and 0.0 < value <= 1.0)
    if not ok:
        raise ConfigError(f"{op}: {name} must be a number of batches (an integer >= 1), a fraction of them (a float "
                          f"in (0, 1]) or None, got {value!r}")


def evaluate(
    runner: Runner, data: EvalData, metrics: Optional[Mapping[str, Metric]] = None, *, ema: bool = False,
    draws: str = "restore", limit_batches: Union[None, int, float] = None,
) -> dict[str, float]:
    """The mean loss and metrics of ``runner`` on ``data``, in eval mode, with no gradient
    and no buffer update; the runner's mode is left as found, and the random generators
    too (``draws="restore"``), or as a hand-written loop leaves them (``"advance"``: the
    loader's iterator has drawn its seed from the global generator).
    Reads the results back to the host once (a device sync on CUDA), as asked.

    Args:
        runner: the model to evaluate.
        data: a sample list, a ``Dataset``, a ``DataLoader``, a torch DataLoader or any
            iterable of batches, read lazily.
        metrics: ``{name: fn(output, target) -> tensor}`` (``leantrain.metrics.accuracy``);
            one value per example is averaged over examples, one per item over items.
        ema: evaluate the moving average of the weights (``ema_decay``) in their place.
        draws: ``"restore"`` (every generator put back: torch's, CUDA's, Python's, NumPy's
            and the loader's own) or ``"advance"`` (left as the pass leaves them).
        limit_batches: at most that many of the data's batches (an integer), or that
            fraction of them (a float in (0, 1]), as Lightning's ``limit_val_batches``.

    Returns:
        ``{"loss": mean loss over the examples, name: metric, ..., "items": count}`` (upstream's rule:
        no item gives a loss of 0.0 with ``items == 0``).

    Raises:
        ConfigError: a bad metric, ``ema=True`` without a moving average.
        DataError: a sample the model rejects.
    """
    op = "evaluate"
    if not isinstance(runner, Runner):
        raise ConfigError(f"{op}: expected a Runner, got {type(runner).__name__}")
    if ema:
        if runner.ema is None:
            raise ConfigError(f"{op}: ema=True but the runner keeps no moving average (train with ema_decay)")
        with runner.ema.applied(runner.params):
            return evaluate(runner, data, metrics, draws=draws, limit_batches=limit_batches)
    metrics = dict(metrics or {})
    for name, fn in metrics.items():
        if not isinstance(name, str) or not callable(fn) or name in ("loss", "items"):
            raise ConfigError(f"{op}: metric {name!r}: expected a name (not 'loss' or 'items') and a callable")
    check_choice(op, "draws", draws, ("restore", "advance"))
    check_limit(op, "limit_batches", limit_batches)
    items = eval_items(op, data, limit_batches)
    sums = {name: [torch.zeros((), dtype=torch.float64, device=runner.device), 0] for name in metrics}
    total, n, weighted, rows = None, 0, None, []
    with runner.in_mode("eval"):
        kept = rng_preserved(runner.device, loader_generators(data)) if draws == "restore" else nullcontext()
        with kept, torch.no_grad(), runner.binding(op) as bound, bound.scratch_buffers():
            for sample in items:
                n += 1
                s = runner.inputs(sample)
                with runner.autocast():
                    out = call_model(runner.module, s)
                    loss = checked_loss(op, runner.loss_fn(out, loss_target(s)))
                total = loss if total is None else add_losses(total, loss)
                if not isinstance(loss, LossSum):  # an item's mean weighs as many examples as it holds
                    rows.append(examples_in(loss_target(s)))
                    weighted = loss * rows[-1] if weighted is None else weighted + loss * rows[-1]
                for name, fn in metrics.items():
                    value = fn(out, loss_target(s))
                    if not isinstance(value, torch.Tensor):
                        raise ConfigError(f"{op}: metric {name!r} returned {type(value).__name__}, expected a tensor")
                    sums[name][0] += value.to(torch.float64).sum()
                    sums[name][1] += value.numel()  # a 0-dim value per item counts 1; per example, each
    if n == 0:
        return {"loss": 0.0, **{name: 0.0 for name in metrics}, "items": 0.0}  # upstream's rule
    if isinstance(total, LossSum):  # the sum of totals over the sum of counts
        results = {"loss": float((total.total / total.count).item())}  # intentional sync: asked for
    elif len(set(rows)) == 1:  # items of one size: the mean over examples is upstream's mean of items
        results = {"loss": float((total * (1.0 / n)).item())}  # intentional sync: asked for
    else:  # the mean over examples, as Trainer and Lightning report it (a short last batch weighs less)
        results = {"loss": float((weighted * (1.0 / sum(rows))).item())}  # intentional sync: asked for
    for name, (s, k) in sums.items():
        results[name] = float(s.item()) / k if k else 0.0  # intentional sync
    results["items"] = float(n)
    return results


def examples_in(target) -> int:
    """How many examples an item's loss averages over: the rows of its target (a dict
    sample's ``labels``, else its first tensor), 1 for a scalar target."""
    if isinstance(target, Mapping):
        target = target.get("labels", next((v for v in target.values() if isinstance(v, torch.Tensor)), None))
    return int(target.shape[0]) if isinstance(target, torch.Tensor) and target.dim() >= 1 else 1


def check_eval_sets(op: str, data: object) -> None:
    """A loop's ``eval_data``: ``None``, one set, or a dict of named sets (names made of
    letters, digits and ``_``); no set empty."""
    sets = data if isinstance(data, Mapping) else {None: data}
    if isinstance(data, Mapping) and not data:
        raise ConfigError(f"{op}: eval_data is an empty dict: name at least one evaluation set")
    for name, one in sets.items():
        where = "eval_data" if name is None else f"eval_data[{name!r}]"
        if name is not None and not (isinstance(name, str) and name.replace("_", "a").isalnum()):
            raise ConfigError(f"{op}: eval_data's set names must be words (letters, digits, _), got {name!r}")
        if isinstance(one, Mapping):
            raise ConfigError(f"{op}: {where} is a dict: give a sample list, a Dataset or a loader")
        if one is not None and hasattr(one, "__len__") and len(one) == 0:
            raise ConfigError(f"{op}: {where} is empty: an evaluation over nothing measures nothing")


def evaluate_sets(runner: Runner, data: Union[EvalData, Mapping[str, EvalData]],
                  metrics: Optional[Mapping[str, Metric]] = None, *, ema: bool = False,
                  draws: str = "restore", limit_batches=None) -> dict[str, float]:
    """``evaluate`` on one set, or on each named set of a dict with its results' names
    prefixed by the set's (``val_loss``, ``test_accuracy``), in the dict's order."""
    if not isinstance(data, Mapping):
        return evaluate(runner, data, metrics, ema=ema, draws=draws, limit_batches=limit_batches)
    out: dict[str, float] = {}
    for name, one in data.items():
        out.update({f"{name}_{k}": v for k, v in evaluate(runner, one, metrics, ema=ema, draws=draws,
                                                         limit_batches=limit_batches).items()})
    return out


def predict(runner: Runner, data: EvalData, *, collect: bool = False, to: Optional[Any] = None):
    """The model's output for each item of ``data`` (a sample list, a ``Dataset``, a
    loader: a collated batch is one item), in eval mode with no gradient and no buffer
    update, the runner's mode restored after each item.

    Streamed: returns an iterator that computes one item's output when asked, so memory
    does not grow with the data; ``collect=True`` returns the list of every output
    instead. ``to``: a device to move each output to (``"cpu"`` frees the accelerator's
    memory as outputs are kept); outputs are detached.

    Random numbers: each model call leaves torch's generators as it found them (a model
    that draws in eval mode does not move the caller's sequence), and a torch loader's own
    generators are put back once its iterator has drawn its order (when the first item is
    read); nothing is restored later, ever (not at the walk's end, not when an abandoned
    iterator is collected): the caller's own draws between items stay theirs. A loader
    without a generator of its own draws its order from the global one, as in a plain loop.

    Raises:
        ConfigError: ``runner`` is not a Runner, ``data`` is not data.
        DataError: a sample the model rejects.
    """
    op = "predict"
    if not isinstance(runner, Runner):
        raise ConfigError(f"{op}: expected a Runner, got {type(runner).__name__}")
    items = eval_items(op, data)
    uncollated = isinstance(data, DataLoader) and data.collate is None
    outputs = _outputs(runner, items, loader_generators(data), to, uncollated)
    return list(outputs) if collect else outputs


def _outputs(runner: Runner, items: Iterator[Sample], generators: list, to, uncollated: bool = False
             ) -> Iterator[Any]:
    own = [(g, g.get_state()) for g in generators]
    for k, sample in enumerate(items):
        if k == 0:  # the loader's iterator has drawn its order: its own generators as found
            for g, state in own:
                g.set_state(state)
        with rng_preserved(runner.device), runner.in_mode("eval"), torch.no_grad(), \
                runner.binding("predict") as bound, bound.scratch_buffers():
            s = runner.inputs(sample)
            try:
                with runner.autocast():
                    out = call_model(runner.module, s)
            except MODEL_ERRORS as e:
                if isinstance(e, LeantrainError):
                    raise
                hint = (" (a leantrain DataLoader without collate= gives each sample as its own item, unbatched: "
                        "give collate=torch.utils.data.default_collate to predict on minibatches)") if uncollated else ""
                raise DataError(f"predict: item {k}: the model rejected the sample ({describe(s)}): "
                                f"{str(e).splitlines()[0]}{hint}") from e
        yield _moved(out, to)


def _moved(out: Any, to) -> Any:
    """``out`` detached (tensors inside dicts, tuples, namedtuples and model outputs too:
    torch's pytrees, each container as built), on ``to``."""
    if isinstance(out, torch.Tensor):
        out = out.detach()
        return out if to is None else out.to(to)
    if isinstance(out, Mapping) and type(out) not in pytree.SUPPORTED_NODES:  # a mapping torch does not walk
        moved = {k: _moved(v, to) for k, v in out.items()}
        try:
            return type(out)(moved)
        except TypeError:
            return moved
    return pytree.tree_map_only(torch.Tensor, lambda t: _moved(t, to), out)
