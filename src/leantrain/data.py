"""In-memory datasets and the deterministic data loader (spec §8).

The shuffle is the upstream LCG, ``s' = (1103515245*s + 12345) mod 2**31``: each
item in order is paired with the next ``s``, the pairs are sorted by key, and the
new order *persists*: the next epoch shuffles the already shuffled order with the
advanced seed. Batch order is therefore identical across runs and resumes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Callable, Generic, Iterable, Iterator, Optional, TypeVar

import numpy
import torch

from .errors import ConfigError, DataError
from .validate import check_bool, check_count

T = TypeVar("T")
U = TypeVar("U")

LCG_MULTIPLIER, LCG_INCREMENT, LCG_MODULUS = 1103515245, 12345, 2**31


def lcg_next(s: int) -> int:
    return (LCG_MULTIPLIER * s + LCG_INCREMENT) % LCG_MODULUS


def lcg_permutation_per_item(seed: int, n: int) -> tuple[int, list[int]]:
    """Upstream's form of ``lcg_permutation``: each key in turn, (key, position) pairs
    sorted. Kept as the reference the vectorised form is tested and timed against."""
    keyed, s = [], seed
    for i in range(n):
        s = lcg_next(s)
        keyed.append((s, i))
    keyed.sort()
    return s, [i for _, i in keyed]


_BLOCK = 1024


def lcg_keys(seed: int, n: int) -> numpy.ndarray:
    """The next ``n`` LCG values after ``seed``, vectorised: the first block one by one,
    each later block from the one before by the LCG's ``_BLOCK``-step jump (``a**B`` and
    ``c*(a**(B-1) + ... + 1)`` mod 2**31; products stay below 2**62 in uint64)."""
    keys = numpy.empty(n, dtype=numpy.uint64)
    s = seed
    for i in range(min(n, _BLOCK)):
        s = lcg_next(s)
        keys[i] = s
    if n > _BLOCK:
        jump_a, jump_c = 1, 0
        for _ in range(_BLOCK):  # the composition of B steps: s -> jump_a*s + jump_c
            jump_a = (LCG_MULTIPLIER * jump_a) % LCG_MODULUS
            jump_c = (LCG_MULTIPLIER * jump_c + LCG_INCREMENT) % LCG_MODULUS
        a, c, m = numpy.uint64(jump_a), numpy.uint64(jump_c), numpy.uint64(LCG_MODULUS)
        for start in range(_BLOCK, n, _BLOCK):
            stop = min(n, start + _BLOCK)
            keys[start:stop] = (keys[start - _BLOCK:stop - _BLOCK] * a + c) % m
    return keys


def lcg_permutation(seed: int, n: int) -> tuple[int, list[int]]:
    """Pair position ``i`` with the ``i``-th next LCG value, sort by it (ties keep order:
    a stable argsort); return the advanced seed and the resulting order of positions."""
    if n == 0:
        return seed, []
    keys = lcg_keys(seed, n)
    return int(keys[-1]), numpy.argsort(keys, kind="stable").tolist()


def list_batch(op: str, batch: object) -> list:
    """A loader batch (a collate's result) as the list batch every pass reads (training,
    the before/after passes, evaluation, ``predict``, ``find_lr``, ``check``): a list of
    samples as it is; one collated ``(x, y)`` pair of tensors (``default_collate`` gives a
    list of two) or one collated mapping (a Hugging Face collator's ``BatchEncoding``, as a
    dict): a list of that one item; anything else a ``DataError``."""
    if isinstance(batch, Mapping):
        return [dict(batch)]
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch):
        return [(batch[0], batch[1])]
    if isinstance(batch, (tuple, list)):
        return [dict(s) if isinstance(s, Mapping) else s for s in batch]
    raise DataError(
        f"{op}: a loader batch must be a list of samples, one (x, y) pair of tensors or one dict of "
        f"the model's inputs, got {type(batch).__name__}"
    )


def dataset_length(op: str, dataset, what: str = "the dataset") -> int:
    """``len(dataset)``, checked: an integer >= 0 (below 2**62), or a ``DataError`` naming
    what the dataset's ``__len__`` returned (Python's own errors say less: a float is "cannot
    be interpreted as an integer", -1 "should return >= 0", 10**20 "cannot fit")."""
    got = type(dataset).__len__(dataset)
    if not (isinstance(got, int) and not isinstance(got, bool) and 0 <= got < 2**62):
        raise DataError(f"{op}: {what}'s __len__() returned {got!r:.40}: expected an integer >= 0 (below 2**62)")
    return got


def map_style(data: object) -> bool:
    """A dataset read by index: ``len()`` and ``[i]`` (a list, a torch map-style Dataset, a
    ``datasets.Dataset``), not an iterable-only one."""
    if isinstance(data, (str, bytes, Mapping)) or isinstance(data, torch.utils.data.IterableDataset):
        return False
    return hasattr(data, "__len__") and hasattr(data, "__getitem__")


class Dataset(Generic[T]):
    """An immutable, ordered collection of samples."""

    __slots__ = ("samples",)

    def __init__(self, samples: Iterable[T] = ()) -> None:
        self.samples: tuple = tuple(samples)

    def __repr__(self) -> str:
        return f"Dataset({len(self.samples)} samples)"

    @classmethod
    def of_list(cls, samples: Iterable[T]) -> "Dataset[T]":
        """A dataset of ``samples``, in order."""
        return cls(samples)

    def to_list(self) -> list[T]:
        """The samples as a new list, in stored order."""
        return list(self.samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self) -> Iterator[T]:
        return iter(self.samples)

    def __getitem__(self, i: int) -> T:
        return self.samples[i]

    @property
    def size(self) -> int:
        """The number of samples."""
        return len(self.samples)

    def is_empty(self) -> bool:
        """Whether the dataset holds no sample."""
        return not self.samples

    def get(self, i: int):
        """The item at ``i``, or ``None`` when out of range."""
        return self.samples[i] if 0 <= i < len(self.samples) else None

    def map(self, f: Callable[[T], U]) -> "Dataset[U]":
        """A dataset of ``f(sample)`` for every sample, in order."""
        return Dataset(f(x) for x in self.samples)

    def append(self, other: "Dataset[T]") -> "Dataset[T]":
        """This dataset's samples followed by ``other``'s."""
        return Dataset(self.samples + tuple(other.samples))

    def split_at(self, n: int) -> tuple["Dataset[T]", "Dataset[T]"]:
        """The first ``n`` items and the rest, order kept."""
        return Dataset(self.samples[:n]), Dataset(self.samples[n:])

    def shuffle(self, seed: int) -> tuple[int, "Dataset[T]"]:
        """``(advanced seed, permuted dataset)`` by the upstream LCG sort."""
        seed, perm = lcg_permutation(seed, len(self.samples))
        return seed, Dataset(self.samples[p] for p in perm)

    def batches(self, tag: str, batch_size: int) -> list[list[T]]:
        """Contiguous chunks of ``batch_size``; the last may be short."""
        if batch_size <= 0:
            raise DataError(f"{tag}: batch_size must be > 0, got {batch_size}")
        if not self.samples:
            raise DataError(f"{tag}: empty dataset")
        n = len(self.samples)
        return [list(self.samples[i : i + batch_size]) for i in range(0, n, batch_size)]


@dataclass(frozen=True)
class DataLoader(Generic[T]):
    """Batches over a dataset with the seeded, persistent shuffle. Immutable: ``epoch``
    returns the loader to use next time (carrying the new order and seed).

    ``collate`` (optional) maps each batch of dataset items to the list batch the loop
    trains on, e.g. ``B*K`` single samples to ``K`` stacked minibatches of ``B``, or to
    one item (a dict such as ``leantrain.collate.pad_tokens`` makes, or an ``(x, y)``
    pair of tensors): a list batch of that one item. It runs as each batch is read.

    ``rank``/``world_size`` (both or neither): under ``torch.distributed``, this rank
    reads only its share of every batch, the items at positions ``rank, rank +
    world_size, ...`` (the items data parallel gives this rank anyway), and collates
    only those. ``batch_size`` stays the batch of all ranks together (a multiple of
    ``world_size``), so the order, the batches and a checkpoint's position are those of
    one process, and a run resumes at any world size.

    ``dataset`` may be any map-style dataset (``len()`` and ``[i]``: a torch Dataset, a
    ``datasets.Dataset``): its items are read by index when a batch is reached, never
    copied; the order is the same seeded order. ``num_workers`` processes read and collate
    them (``pin_memory``, ``prefetch_factor`` as torch's); the batches and their order are
    the same as without workers. With workers each item is read with the generators
    (torch's, ``random``'s, numpy's) seeded from the loader's seed, the epoch and the
    item, so random augmentation gives the same items on every run and after a resume at
    any batch (not the main process's draws: a run without workers draws from the global
    generator, which a checkpoint restores)."""

    dataset: Dataset
    batch_size: int
    shuffle: bool = False
    seed: int = 0
    drop_last: bool = False
    order: Optional[tuple[int, ...]] = None  # dataset[i] is the original item order[i]
    collate: Optional[Callable[[list], list]] = None  # turns each batch into its list batch
    rank: Optional[int] = None  # with world_size: read only this rank's share of each batch
    world_size: Optional[int] = None
    num_workers: int = 0  # processes reading (and collating) a map-style dataset's items
    pin_memory: bool = False
    prefetch_factor: Optional[int] = None  # batches each worker reads ahead (torch's default: 2)
    passes: int = 0  # epochs begun: with workers, part of each item's generator seed

    def __post_init__(self) -> None:
        op = "DataLoader"
        check_count(op, "num_workers", self.num_workers, 0)
        check_bool(op, "pin_memory", self.pin_memory)
        if self.prefetch_factor is not None:
            check_count(op, "prefetch_factor", self.prefetch_factor, 1)
            if self.num_workers == 0:
                raise ConfigError(f"{op}: prefetch_factor needs num_workers > 0 (the workers read ahead)")
        if not isinstance(self.dataset, Dataset):
            if not map_style(self.dataset):
                raise ConfigError(
                    f"{op}: dataset must be a Dataset, a list of samples or a map-style dataset (len() and "
                    f"[i], e.g. a torch Dataset or a datasets.Dataset), got {type(self.dataset).__name__}"
                )
            if isinstance(self.dataset, (list, tuple)) and self.num_workers == 0:
                object.__setattr__(self, "dataset", Dataset(self.dataset))
            else:
                dataset_length(op, self.dataset)  # a length the loader can use, checked once here
        check_count(op, "batch_size", self.batch_size, 1)
        check_count(op, "seed", self.seed, 0)
        for name in ("shuffle", "drop_last"):
            check_bool(op, name, getattr(self, name))
        if (self.rank is None) != (self.world_size is None):
            raise ConfigError(f"{op}: give rank and world_size together (got rank={self.rank!r}, "
                              f"world_size={self.world_size!r})")
        if self.world_size is not None:
            check_count(op, "world_size", self.world_size, 1)
            check_count(op, "rank", self.rank, 0)
            if self.rank >= self.world_size:
                raise ConfigError(f"{op}: rank must be < world_size, got rank={self.rank}, "
                                  f"world_size={self.world_size}")
            if self.batch_size % self.world_size:
                raise ConfigError(
                    f"{op}: batch_size is the batch of all ranks together and must be a multiple of "
                    f"world_size, got batch_size={self.batch_size}, world_size={self.world_size} (each rank "
                    f"reads batch_size // world_size items of every batch)")

    def epoch(self, tag: str = "DataLoader.epoch") -> tuple["DataLoader[T]", list[list[T]]]:
        """One pass: ``(next loader, batches)``. A short last batch is dropped with ``drop_last``."""
        nxt, batches = self.epoch_batches(tag)
        return nxt, list(batches)

    def epoch_batches(self, tag: str = "DataLoader.epoch", skip: int = 0) -> tuple["DataLoader[T]", Iterator[list]]:
        """One pass, read lazily: ``(next loader, an iterator of its batches after the first
        ``skip``)``, each batch cut to this rank's share and collated only when reached
        (a skipped batch is never collated)."""
        if self.lazy:
            return self._lazy_epoch(tag, skip)
        nxt = self
        if self.shuffle:
            seed, perm = lcg_permutation(self.seed, len(self.dataset))
            order = self.current_order()
            nxt = replace(
                self,
                dataset=Dataset(self.dataset.samples[p] for p in perm),
                seed=seed,
                order=tuple(order[p] for p in perm),
            )
        raw = nxt.dataset.batches(tag, self.batch_size)  # lists of references to the stored items
        if self.drop_last:
            raw = [b for b in raw if len(b) == self.batch_size]
        return nxt, (self.read(b) for b in raw[skip:])

    @property
    def lazy(self) -> bool:
        """Whether the items stay in the user's dataset, read by index when a batch is reached
        (a map-style dataset, or any dataset with ``num_workers``)."""
        return not isinstance(self.dataset, Dataset)

    def _lazy_epoch(self, tag: str, skip: int) -> tuple["DataLoader[T]", Iterator[list]]:
        """One pass over a map-style dataset: the same seeded order as an in-memory one, as
        index lists, each read (by ``num_workers`` processes, or here) when reached."""
        n = dataset_length(tag, self.dataset)
        if n == 0:
            raise DataError(f"{tag}: empty dataset")
        if self.order is not None and len(self.order) != n:
            raise DataError(f"{tag}: the dataset's length changed from {len(self.order)} to {n} since the run began "
                            f"(a dataset read by index must keep its items; an epoch's order and a resume's "
                            f"position depend on them)")
        order = self.current_order()
        nxt = replace(self, passes=self.passes + 1)
        if self.shuffle:
            seed, perm = lcg_permutation(self.seed, n)
            order = tuple(order[p] for p in perm)
            nxt = replace(nxt, seed=seed, order=order)
        k = self.batch_size
        raw = [list(order[i:i + k]) for i in range(0, n, k)]
        if self.drop_last:
            raw = [b for b in raw if len(b) == k]
        mine = [self.share(b) for b in raw[skip:]]
        if self.num_workers == 0:
            return nxt, (self._collated([self.dataset[i] for i in b]) for b in mine)
        from .loader_workers import worker_batches
        return nxt, worker_batches(self, mine, (self.seed, self.passes))

    def _collated(self, items: list) -> list:
        return list_batch("DataLoader.collate", self.collate(items)) if self.collate is not None and items else items

    def read(self, batch: list) -> list:
        """A batch as the loop trains on it: this rank's share, collated (``batch``: items,
        or original indices when the loader is ``lazy``)."""
        mine = self.share(batch)
        if self.lazy:
            mine = [self.dataset[i] for i in mine]
        return self._collated(mine)

    def share(self, batch: list) -> list:
        """This rank's items of a batch (all of them without ``rank``/``world_size``)."""
        return batch if self.world_size is None else batch[self.rank::self.world_size]

    def items(self, tag: str = "DataLoader.items") -> list:
        """Every item one pass would train on, in stored order (collated when set)."""
        return list(self.iter_items(tag))

    def iter_items(self, tag: str = "DataLoader.items", limit: Optional[int] = None) -> Iterator:
        """The items of ``items``, read batch by batch as they are needed, from at most
        ``limit`` batches (``None``: all)."""
        if self.lazy:
            order, k = self.current_order(), self.batch_size
            batches = [list(order[i:i + k]) for i in range(0, len(order), k)]
            return (item for b in batches[:limit] for item in self.read(b))
        if self.collate is None and self.world_size is None and limit is None:
            return iter(self.dataset.samples)
        batches = self.dataset.batches(tag, self.batch_size)
        return (item for b in batches[:limit] for item in self.read(b))

    def current_order(self) -> tuple[int, ...]:
        """``order[i]``: the original index of the item now stored at ``i``."""
        return self.order if self.order is not None else tuple(range(len(self.dataset)))

    def state(self) -> dict:
        """What a checkpoint needs to rebuild this loader from the original one."""
        out = {
            "batch_size": self.batch_size, "shuffle": self.shuffle, "seed": self.seed,
            "drop_last": self.drop_last, "order": list(self.current_order()),
        }
        if self.lazy:
            out["passes"] = self.passes  # the workers' item seeds depend on it
        return out

    def restored(self, state: dict, op: str = "DataLoader.restored") -> "DataLoader[T]":
        """This loader's data in the saved order with the saved seed (checks they fit)."""
        n = len(self.dataset)
        order = state.get("order", [])
        for key in ("batch_size", "shuffle", "drop_last"):
            if state.get(key) != getattr(self, key):
                raise DataError(
                    f"{op}: loader {key}: checkpoint has {state.get(key)!r}, this loader has "
                    f"{getattr(self, key)!r}"
                )
        seed = state.get("seed")
        if not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**64):
            raise DataError(f"{op}: loader seed: checkpoint has {seed!r}, expected an integer in [0, 2**64)")
        if sorted(order) != list(range(n)):
            raise DataError(
                f"{op}: the saved order is not a permutation of this loader's {n} items "
                f"(it has {len(order)}); resume with the same data set"
            )
        passes = state.get("passes", 0)
        if not (isinstance(passes, int) and not isinstance(passes, bool) and passes >= 0):
            raise DataError(f"{op}: loader passes: checkpoint has {passes!r}, expected an integer >= 0")
        if self.lazy:  # the dataset stays where it is: the order is the whole position
            return replace(self, seed=seed, order=tuple(order), passes=passes)
        base: list = [None] * n
        for j, o in enumerate(self.current_order()):
            base[o] = self.dataset.samples[j]
        return replace(self, dataset=Dataset(base[o] for o in order), seed=seed, order=tuple(order))

    def __len__(self) -> int:
        n, k = len(self.dataset), self.batch_size
        return n // k if self.drop_last else -(-n // k)

    def __iter__(self) -> Iterator[list]:
        """One pass per ``for`` (``epoch()``'s batches); the loader then stands at the next pass,
        as torch's reshuffles per iteration (``epoch()``: the value form, nothing changed)."""
        nxt, batches = replace(self).epoch_batches("DataLoader.__iter__")  # read from a copy of this pass
        for f in fields(self):  # a frozen dataclass: the next pass's state taken in place
            object.__setattr__(self, f.name, getattr(nxt, f.name))
        return batches

