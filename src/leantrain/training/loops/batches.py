"""Reading batches from a loader: the loader loop's and ``evaluate``'s shared rules."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Iterable, Iterator, Optional, Union

import torch

from ...data import DataLoader, list_batch
from ..runner.runner import Sample

Loader = Union[DataLoader, Iterable]


as_list_batch = list_batch  # one reading of a loader's batch for every pass (data.list_batch)


def examples_in(raw: object, items: list) -> int:
    """How many examples a loader batch holds: a collated batch's leading size (its
    target's, or a dict's ``input_ids``' or first tensor's), else one per item."""
    t = None
    if isinstance(raw, Mapping):
        t = raw.get("input_ids", next((v for v in raw.values() if isinstance(v, torch.Tensor)), None))
    elif len(items) == 1 and isinstance(raw, (tuple, list)) and len(raw) == 2 and isinstance(raw[1], torch.Tensor):
        t = raw[1]
    return t.shape[0] if isinstance(t, torch.Tensor) and t.dim() > 0 else len(items)


def plain_tensor_loader(loader: object) -> bool:
    """A plain ``torch.utils.data.DataLoader`` on a two-tensor ``TensorDataset`` (default
    collate, no workers, no pinned memory, batched): each batch is one ``(x, y)`` pair."""
    tdata = torch.utils.data
    return (type(loader) is tdata.DataLoader and type(loader.dataset) is tdata.TensorDataset
            and len(loader.dataset.tensors) == 2 and loader.collate_fn is tdata.default_collate
            and loader.num_workers == 0 and not loader.pin_memory and loader.batch_sampler is not None)


def fast_batches(loader: object, it: Optional[Iterator] = None) -> Optional[Iterator[tuple[torch.Tensor, torch.Tensor]]]:
    """One pass over a plain ``torch.utils.data.DataLoader`` on a two-tensor
    ``TensorDataset`` (default collate, no workers, no pinned memory) without its per-item
    loop: the index lists come from the DataLoader's own iterator (so the shuffle and the
    random draws are exactly those of iterating it) and each batch is gathered with one
    indexing call per tensor, the bits ``default_collate`` stacks. ``it``: that iterator,
    already started (and perhaps advanced); ``None`` for any other loader (iterate it as
    it is)."""
    if not plain_tensor_loader(loader):
        return None
    if it is None:
        it = iter(loader)  # the DataLoader's own start: its seed draws and its sampler
    if not hasattr(it, "_next_index"):
        return None
    x, y = loader.dataset.tensors

    def gen() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            try:
                idx = it._next_index()
            except StopIteration:
                return
            index = torch.as_tensor(idx, dtype=torch.long)
            yield x[index], y[index]

    return gen()


def loader_generators(loader: object) -> list[torch.Generator]:
    """The generators iterating ``loader`` draws from (a torch DataLoader's own, its
    sampler's, its batch sampler's and that one's sampler's), each once."""
    found: dict[int, torch.Generator] = {}
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    inner = getattr(batch_sampler, "sampler", None)
    for owner in (loader, sampler, batch_sampler, inner):
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator):
            found.setdefault(id(g), g)
    return list(found.values())


def loader_samples(op: str, loader: Loader) -> Iterator[Sample]:
    """The samples of one pass over ``loader``, read batch by batch as they are needed
    (nothing kept): a leantrain DataLoader's items, or each raw batch's list batch. The
    caller keeps the loader's generators as they were (``rng_preserved``) when the pass
    must not change what training draws next."""
    if isinstance(loader, DataLoader):
        yield from loader.iter_items(op)
        return
    for raw in fast_batches(loader) or loader:
        yield from as_list_batch(op, raw)
