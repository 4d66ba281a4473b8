"""A loader as the loader loop reads it: the ``Stream`` interface every kind of loader
implements (``loader_kinds.py`` holds the kinds and picks one, ``stream_of``).

A stream reads its loader lazily, one pass per epoch, and knows its position for a
checkpoint: ``epoch`` (the raw batches of a pass, after those a resumed run did),
``state`` (what a checkpoint records), ``problems`` (why a checkpoint's record cannot
resume it), ``restore`` (the checkpoint's position put in place), ``measurable``
(whether a measuring pass can read it without changing what training reads). Nothing is
read ahead, counted or kept: a pass yields the loader's batches as they come (the torch
DataLoader's own prefetch is the only read-ahead), so memory does not grow with the
dataset and a loader without ``len()`` (an endless stream) trains.

``TorchStream`` is what every kind but leantrain's own loader shares: the generators
iterating the loader draws from, their states at the start of the current epoch (the
position), put back for a resumed epoch's iterator. Samplers with ``set_epoch``
(``DistributedSampler``) are told each epoch's number first.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Iterator, Optional

import torch

from .batches import as_list_batch, fast_batches, loader_generators, plain_tensor_loader


class Stream:
    """One loader, read epoch by epoch; knows its position for a checkpoint. The base
    holds what every kind shares; each kind is a subclass."""

    kind = ""  #: the kind's name in checkpoints and messages
    limit: Optional[int] = None  #: batches read per epoch at most (``limit_train_batches``; ``None``: all)

    def __init__(self, op: str, loader: object) -> None:
        self.op, self.loader = op, loader
        self.warned = False

    def epoch(self, epoch: int, skip: int) -> Iterator:
        """The raw batches of pass ``epoch`` after the first ``skip`` (those a resumed run
        did before its checkpoint)."""
        raise NotImplementedError

    def state(self) -> Optional[dict]:
        """What a checkpoint records of the loader now (called when one is written)."""
        raise NotImplementedError

    def problems(self, saved: Optional[dict]) -> list[str]:
        """Why ``saved`` (a checkpoint's loader record) cannot resume this loader."""
        raise NotImplementedError

    def restore(self, saved: Optional[dict], epoch: int, skip: int) -> None:
        """Put the checkpoint's position in place for the resumed epoch (checked by
        ``problems`` first); warn once when it cannot be put back exactly."""
        raise NotImplementedError

    def measurable(self) -> bool:
        """Whether a measuring pass can read the loader without changing what training
        reads (its generators are put back after the pass)."""
        return isinstance(self.loader, (list, tuple))

    def samples(self, limit: Optional[int]) -> Iterator:
        """The samples of one measuring pass over at most ``limit`` batches (``None``: a
        whole pass), read lazily."""
        source = (fast_batches(self.loader) if plain_tensor_loader(self.loader) else None) or iter(self.loader)
        return (s for raw in _first(source, limit) for s in as_list_batch(self.op, raw))

    def size(self) -> Optional[int]:
        """Items in one pass where known without reading (a checkpoint's ``n_samples``):
        a sized torch loader's batches, a list's items."""
        if isinstance(self.loader, (list, tuple)):
            return sum(len(as_list_batch(self.op, b)) for b in self.loader)
        try:
            return len(self.loader)
        except TypeError:
            return None  # an IterableDataset without __len__: unknown, never counted

    def position_problems(self, progress: dict) -> list[str]:
        """Why a checkpoint's position cannot be in this loader: more batches done in its
        epoch than one pass of the loader has (where its length is known)."""
        batch, length = progress.get("batch"), length_of(self.loader)
        if isinstance(batch, int) and batch > length:
            return [f"progress.batch: {batch} batches done in epoch {progress.get('epoch')}, but one pass of this "
                    f"loader has {length}"]
        return []

    def _warn_workers(self, saved: Optional[dict], workers: bool, why: str) -> None:
        """Say so when the checkpoint was written with(out) worker processes and this loader
        reads without (with) them: what a random augmentation draws changes from here on."""
        was = saved.get("workers") if isinstance(saved, dict) else None
        if isinstance(was, bool) and was != workers:
            warnings.warn(f"{self.op}: the checkpoint's loader read {'with' if was else 'without'} worker processes, "
                          f"this one reads {'with' if workers else 'without'}: {why}, so what the dataset draws "
                          f"(random augmentation) differs from the interrupted run from here on", stacklevel=5)

    def _warn(self, epoch: int, skip: int, reason: Optional[str]) -> None:
        if reason and not self.warned:
            self.warned = True
            warnings.warn(f"{self.op}: resuming in epoch {epoch} after {skip} batch(es): {reason}", stacklevel=5)


class TorchStream(Stream):
    """What the kinds other than leantrain's share: the generators iterating the loader
    draws from, their states at the start of the current epoch (the position), put back
    for a resumed epoch's iterator."""

    def __init__(self, op: str, loader: object) -> None:
        super().__init__(op, loader)
        self.generators = loader_generators(loader)
        self.epoch_rng: Optional[tuple] = None  # (global, per generator) at this epoch's start
        self.pending: Optional[dict] = None  # a restored position, for the resumed epoch

    def epoch(self, epoch: int, skip: int) -> Iterator:
        _set_epoch(self.loader, epoch)
        pending, self.pending = self.pending, None
        now = torch.get_rng_state()
        if pending is not None:  # the interrupted epoch's starting draws, for its iterator
            saved = pending["tensors"]
            torch.set_rng_state(saved["global"])
            self.put_back_generators(saved)
        # Starting an epoch's iterator draws from these (the workers' base seed, a
        # sampler's shuffle): what a resume in this epoch puts back.
        self.epoch_rng = (torch.get_rng_state(), [g.get_state() for g in self.generators])
        try:
            it, left = self.start(pending, skip)
        finally:
            if pending is not None:
                torch.set_rng_state(now)  # the run's own randomness from here, as at the checkpoint
        for _ in range(left):  # the workers read and drop them: their random draws replay
            if next(it, _END) is _END:
                break
        return it

    def put_back_generators(self, saved: dict) -> None:
        for k, g in enumerate(self.generators):
            g.set_state(saved[f"generator.{k}"])

    def start(self, pending: Optional[dict], skip: int) -> tuple[Iterator, int]:
        """The epoch's iterator, positioned after the ``skip`` batches done, and how many
        of them are still to be read and dropped (once the run's generators are back)."""
        it = iter(self.loader)
        for _ in range(skip):  # replay: read and drop what the interrupted run did
            if next(it, _END) is _END:
                break
        return it, 0

    def state(self) -> Optional[dict]:
        if self.epoch_rng is None:
            return None
        glob, gens = self.epoch_rng
        tensors = {"global": glob, **{f"generator.{k}": s for k, s in enumerate(gens)}}
        return {"kind": self.kind, "generators": len(gens), "tensors": tensors}

    def problems(self, saved: Optional[dict]) -> list[str]:
        if saved is None:
            return []  # an older checkpoint without a loader position: resumed, with a warning
        got = saved.get("kind") if isinstance(saved, dict) else None
        if got != self.kind:
            return [f"loader: the checkpoint was written with a {got or 'leantrain DataLoader'!s} loader, "
                    f"this run's is {self.kind} ({type(self.loader).__name__})"]
        if saved.get("generators") != len(self.generators):
            return [f"loader: the checkpoint's loader drew from {saved.get('generators')!r} generator(s), "
                    f"this one draws from {len(self.generators)}"]
        return generator_problems(saved.get("tensors", {}), ["global"] + [f"generator.{k}" for k in
                                                                           range(len(self.generators))], "loader")

    def restore(self, saved: Optional[dict], epoch: int, skip: int) -> None:
        self.pending = saved
        reason = self.inexact(skip) if saved is not None else (
            f"the checkpoint holds no position for this loader (written by an older leantrain): the "
            f"{skip} batch(es) done are skipped from a fresh pass, whose order may differ" if skip else None)
        self._warn(epoch, skip, reason)

    def inexact(self, skip: int) -> Optional[str]:
        """Why a resume may not give the interrupted run's batches (``None``: it does)."""
        return None


def generator_problems(tensors: dict, names: list, where: str) -> list[str]:
    """Why the CPU generator states ``tensors[name]`` cannot be put back (torch refuses an
    all-zero or truncated Mersenne Twister state): tried on a scratch generator, before a
    resume installs anything."""
    out = []
    for name in names:
        state = tensors.get(name)
        try:
            torch.Generator().set_state(state)
        except (RuntimeError, TypeError) as e:
            out.append(f"{where}: the saved generator state {name!r} cannot be restored "
                       f"({str(e).splitlines()[0] if str(e) else type(e).__name__})")
    return out


_END = object()


def length_of(loader: object) -> float:
    try:
        return len(loader)
    except TypeError:
        return float("inf")


def _first(source: Iterator, limit: Optional[int]) -> Iterator:
    """At most ``limit`` batches, none pulled beyond them (``None``: all)."""
    return source if limit is None else itertools.islice(source, limit)


def _set_epoch(loader: object, epoch: int) -> None:
    """Tell the samplers that want it which epoch starts (``DistributedSampler``)."""
    seen = set()
    for owner in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if owner is not None and id(owner) not in seen and callable(getattr(owner, "set_epoch", None)):
            seen.add(id(owner))
            owner.set_epoch(epoch)
