"""In-memory datasets and the deterministic data loader (spec §8).

The shuffle is the upstream LCG, ``s' = (1103515245*s + 12345) mod 2**31``: each
item in order is paired with the next ``s``, the pairs are sorted by key, and the
new order *persists*: the next epoch shuffles the already shuffled order with the
advanced seed. Batch order is therefore identical across runs and resumes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Callable, Generic, Iterable, Iterator, Optional, TypeVar

import torch

from .errors import ConfigError, DataError
from .validate import check_bool, check_count

T = TypeVar("T")
U = TypeVar("U")

LCG_MULTIPLIER, LCG_INCREMENT, LCG_MODULUS = 1103515245, 12345, 2**31


def lcg_next(s: int) -> int:
    return (LCG_MULTIPLIER * s + LCG_INCREMENT) % LCG_MODULUS


def lcg_permutation(seed: int, n: int) -> tuple[int, list[int]]:
    """Pair position ``i`` with the ``i``-th next LCG value, sort by it (ties keep order);
    return the advanced seed and the resulting order of positions."""
    keyed, s = [], seed
    for i in range(n):
        s = lcg_next(s)
        keyed.append((s, i))
    keyed.sort()
    return s, [i for _, i in keyed]


def _items(collated) -> list:
    """A collate's result as a list batch: a list as it is; one dict or one ``(x, y)``
    tuple as a list of that one item."""
    if isinstance(collated, Mapping) or (isinstance(collated, tuple) and len(collated) == 2
                                         and isinstance(collated[0], torch.Tensor)):
        return [collated]
    return list(collated)


class Dataset(Generic[T]):
    """An immutable, ordered collection of samples."""

    __slots__ = ("samples",)

    def __init__(self, samples: Iterable[T] = ()) -> None:
        self.samples: tuple = tuple(samples)

    def __repr__(self) -> str:
        return f"Dataset({len(self.samples)} samples)"

    @classmethod
    def of_list(cls, samples: Iterable[T]) -> "Dataset[T]":
        return cls(samples)

    def to_list(self) -> list[T]:
        return list(self.samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self) -> Iterator[T]:
        return iter(self.samples)

    def __getitem__(self, i: int) -> T:
        return self.samples[i]

    @property
    def size(self) -> int:
        return len(self.samples)

    def is_empty(self) -> bool:
        return not self.samples

    def get(self, i: int):
        """The item at ``i``, or ``None`` when out of range."""
        return self.samples[i] if 0 <= i < len(self.samples) else None

    def map(self, f: Callable[[T], U]) -> "Dataset[U]":
        return Dataset(f(x) for x in self.samples)

    def append(self, other: "Dataset[T]") -> "Dataset[T]":
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
    pair of tensors): a list batch of that one item."""

    dataset: Dataset
    batch_size: int
    shuffle: bool = False
    seed: int = 0
    drop_last: bool = False
    order: Optional[tuple[int, ...]] = None  # dataset[i] is the original item order[i]
    collate: Optional[Callable[[list], list]] = None  # turns each batch into its list batch

    def __post_init__(self) -> None:
        op = "DataLoader"
        if not isinstance(self.dataset, Dataset):
            if not isinstance(self.dataset, (list, tuple)):
                raise ConfigError(
                    f"{op}: dataset must be a Dataset or a list of samples, got "
                    f"{type(self.dataset).__name__}"
                )
            object.__setattr__(self, "dataset", Dataset(self.dataset))
        check_count(op, "batch_size", self.batch_size, 1)
        check_count(op, "seed", self.seed, 0)
        for name in ("shuffle", "drop_last"):
            check_bool(op, name, getattr(self, name))

    def epoch(self, tag: str = "DataLoader.epoch") -> tuple["DataLoader[T]", list[list[T]]]:
        """One pass: ``(next loader, batches)``. A short last batch is dropped with ``drop_last``."""
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
        batches = nxt.dataset.batches(tag, self.batch_size)
        if self.drop_last:
            batches = [b for b in batches if len(b) == self.batch_size]
        if self.collate is not None:
            batches = [_items(self.collate(b)) for b in batches]
        return nxt, batches

    def items(self, tag: str = "DataLoader.items") -> list:
        """Every item one pass would train on, in stored order (collated when set)."""
        if self.collate is None:
            return self.dataset.to_list()
        return [item for b in self.dataset.batches(tag, self.batch_size) for item in _items(self.collate(b))]

    def current_order(self) -> tuple[int, ...]:
        return self.order if self.order is not None else tuple(range(len(self.dataset)))

    def state(self) -> dict:
        """What a checkpoint needs to rebuild this loader from the original one."""
        return {
            "batch_size": self.batch_size, "shuffle": self.shuffle, "seed": self.seed,
            "drop_last": self.drop_last, "order": list(self.current_order()),
        }

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
        base: list = [None] * n
        for j, o in enumerate(self.current_order()):
            base[o] = self.dataset.samples[j]
        return replace(
            self, dataset=Dataset(base[o] for o in order), seed=seed, order=tuple(order)
        )

    def __len__(self) -> int:
        n, k = len(self.dataset), self.batch_size
        return n // k if self.drop_last else -(-n // k)

