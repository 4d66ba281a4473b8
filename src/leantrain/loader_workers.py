"""Worker processes for ``leantrain.DataLoader`` over a map-style dataset: torch's
``DataLoader`` machinery fetches the index lists leantrain's order gives (``batch_sampler``),
each item read with the generators seeded from ``(loader seed, epoch, item index)``, so what
a random augmentation draws does not depend on which worker reads it, nor on the batches a
resume skips. Starting the workers draws nothing from the main process's global generator
(torch's reader would draw its base seed there once per epoch, and a resume mid-epoch once
more, moving the model's dropout draws): the reader gets a generator of its own."""

from __future__ import annotations

import random
from typing import Iterator

import torch

_MASK = 2**63 - 1


def item_seed(base: tuple, index: int) -> int:
    """A 63-bit seed from the loader's ``(seed, passes)`` and the item's index (SplitMix64)."""
    z = (base[0] * 0x9E3779B97F4A7C15 + base[1] * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) & _MASK


class SeededItems(torch.utils.data.Dataset):
    """The user's dataset, each item read after seeding the worker's generators."""

    def __init__(self, dataset, base: tuple) -> None:
        self.dataset, self.base = dataset, base

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        seed = item_seed(self.base, index)
        torch.manual_seed(seed)  # the worker process's own generators
        random.seed(seed)
        try:
            import numpy
            numpy.random.seed(seed % 2**32)
        except ImportError:  # pragma: no cover - numpy ships with the package's dependencies
            pass
        return self.dataset[index]


class Collate:
    """The loader's collate as a list batch (picklable for the workers)."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def __call__(self, items: list) -> list:
        return self.loader._collated(items)


def worker_batches(loader, batches: list, base: tuple) -> Iterator[list]:
    """The list batches of ``batches`` (index lists), read by ``loader.num_workers`` processes."""
    if not batches:
        return iter(())
    extra = {} if loader.prefetch_factor is None else {"prefetch_factor": loader.prefetch_factor}
    own = torch.Generator().manual_seed(item_seed(base, -1))  # the workers' base seed: never the global draws
    reader = torch.utils.data.DataLoader(SeededItems(loader.dataset, base), batch_sampler=batches,
                                         collate_fn=Collate(loader), num_workers=loader.num_workers,
                                         pin_memory=loader.pin_memory, generator=own, **extra)
    return iter(reader)
