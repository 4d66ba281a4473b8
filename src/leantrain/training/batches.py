"""Reading batches from a loader: the loader loop's and ``evaluate``'s shared rules."""

from __future__ import annotations

from typing import Iterable, Union

import torch

from ..data import DataLoader
from ..errors import DataError
from .binding import rng_preserved
from .runner import Sample

Loader = Union[DataLoader, Iterable]


def as_list_batch(op: str, batch: object) -> list[Sample]:
    """A loader batch: a list of samples, or one collated ``(x, y)`` pair (a list of one)."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and all(
        isinstance(t, torch.Tensor) for t in batch
    ):
        return [(batch[0], batch[1])]
    if isinstance(batch, (tuple, list)):
        return list(batch)
    raise DataError(
        f"{op}: a loader batch must be a list of (x, y) samples or one (x, y) pair of "
        f"tensors, got {type(batch).__name__}"
    )


def loader_generators(loader: object) -> list[torch.Generator]:
    """The generators iterating ``loader`` draws from (a torch DataLoader's own, its
    sampler's, its batch sampler's sampler's), each once."""
    found: dict[int, torch.Generator] = {}
    sampler = getattr(loader, "sampler", None)
    inner = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    for owner in (loader, sampler, inner):
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator):
            found.setdefault(id(g), g)
    return list(found.values())


def loader_items(op: str, loader: Loader, device: torch.device) -> list[Sample]:
    """Every item of one pass over ``loader``, read without consuming its randomness:
    a shuffled torch DataLoader then yields the same epochs as in the user's own loop."""
    if isinstance(loader, DataLoader):
        items = loader.items(op)
    else:
        with rng_preserved(device, loader_generators(loader)):
            items = [s for raw in loader for s in as_list_batch(op, raw)]
    if not items:
        raise DataError(f"{op}: empty dataset")
    return items
