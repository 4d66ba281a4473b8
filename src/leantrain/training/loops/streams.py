"""A loader as the loader loop reads it: lazily, one pass per epoch, its position saved in
checkpoints and put back exactly where the loader allows it.

Nothing is read ahead, counted or kept: a pass yields the loader's batches as they come
(the torch DataLoader's own prefetch is the only read-ahead), so memory does not grow
with the dataset and a loader without ``len()`` (an endless stream) trains. The kinds,
chosen once per loop (``kind_of``):

* ``"leantrain"``: a ``leantrain.DataLoader``; its seeded order is its position.
* ``"sampled"``: a ``torch.utils.data.DataLoader`` over a map-style dataset. An epoch's
  order is drawn when its iterator starts (the sampler's shuffle, the workers' base
  seed), from the loader's and the samplers' generators, or the global generator where
  they have none. Their states at the start of the current epoch are the position; a
  resume puts them back, starts the epoch's iterator as the interrupted run did, and
  skips the batches done by their index lists, reading no data (with ``num_workers > 0``
  the workers read and drop them, so what the dataset draws in the workers replays).
* ``"stateful"``: a loader with ``state_dict``/``load_state_dict`` (torchdata's
  ``StatefulDataLoader``): its own state is the position.
* ``"iterable"``: a torch DataLoader without workers over an ``IterableDataset`` that
  has ``state_dict``/``load_state_dict``: the dataset's state is the position.
* ``"replay"``: anything else. A list or tuple of batches is read again exactly; any other
  iterable (a plain ``IterableDataset``) is resumed by reading and dropping the batches
  done, with a warning that says so.

Samplers with ``set_epoch`` (``DistributedSampler``) are told each epoch's number first.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Iterator, Optional

import torch

from ..runner.binding import rng_preserved

from ...data import DataLoader
from ...errors import DataError
from .batches import as_list_batch, fast_batches, loader_generators, plain_tensor_loader
from ...io.nested import decode, encode


def _torch_loader(loader: object) -> bool:
    return isinstance(loader, torch.utils.data.DataLoader)


def _map_style(loader: object) -> bool:
    return _torch_loader(loader) and not isinstance(loader.dataset, torch.utils.data.IterableDataset)


def _has_state(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def kind_of(loader: object) -> str:
    if isinstance(loader, DataLoader):
        return "leantrain"
    if _has_state(loader) and _map_style(loader) and loader.num_workers > 0:
        # torchdata's StatefulDataLoader with workers: its state fast-forwards the sampler but
        # not the workers' generators, so random augmentation would draw other numbers after
        # a resume. Replayed as a torch loader instead: the epoch's generators put back and
        # the batches done read (by the workers) and dropped, so the workers draw as before.
        return "sampled"
    if _has_state(loader):
        return "stateful"
    if _map_style(loader):
        return "sampled"
    if _torch_loader(loader) and loader.num_workers == 0 and _has_state(loader.dataset):
        return "iterable"
    return "replay"


class Stream:
    """One loader, read epoch by epoch; knows its position for a checkpoint."""

    def __init__(self, op: str, loader: object) -> None:
        self.op, self.loader, self.kind = op, loader, kind_of(loader)
        self.at_start = loader  # the leantrain loader as it was when the epoch began
        self.generators = loader_generators(loader) if self.kind != "leantrain" else []
        self.epoch_rng: Optional[tuple] = None  # (global, per generator) at this epoch's start
        self.pending: Optional[dict] = None  # a restored position, for the resumed epoch
        self.warned = False

    # ------------------------------------------------------------------ epochs
    def epoch(self, epoch: int, skip: int) -> Iterator:
        """The raw batches of pass ``epoch`` after the first ``skip`` (those a resumed run
        did before its checkpoint)."""
        if self.kind == "leantrain":
            self.at_start = self.loader
            self.loader, batches = self.loader.epoch_batches(self.op, skip)
            return batches
        _set_epoch(self.loader, epoch)
        pending, self.pending = self.pending, None
        now = torch.get_rng_state()
        if pending is not None:  # the interrupted epoch's starting draws, for its iterator
            saved = pending["tensors"]
            torch.set_rng_state(saved["global"])
            if self.kind != "stateful":  # a stateful loader's own state brings its generators back
                for k, g in enumerate(self.generators):
                    g.set_state(saved[f"generator.{k}"])
        # Starting an epoch's iterator draws from these (the workers' base seed, a
        # sampler's shuffle): what a resume in this epoch puts back.
        self.epoch_rng = (torch.get_rng_state(), [g.get_state() for g in self.generators])
        try:
            it, left = self._start(pending, skip)
        finally:
            if pending is not None:
                torch.set_rng_state(now)  # the run's own randomness from here, as at the checkpoint
        for _ in range(left):  # the workers read and drop them: their random draws replay
            if next(it, _END) is _END:
                break
        return it

    def _start(self, pending: Optional[dict], skip: int) -> tuple[Iterator, int]:
        """The epoch's iterator, positioned after the ``skip`` batches done, and how many
        of them are still to be read and dropped (once the run's generators are back)."""
        loader = self.loader
        if self.kind in ("stateful", "iterable") and pending is not None:
            target = loader if self.kind == "stateful" else loader.dataset
            target.load_state_dict(decode(pending["state"], pending.get("tensors", {})))
            it = iter(()) if skip >= _length(loader) else iter(loader)  # continues after the batches done
            if self.kind == "stateful":
                # torchdata's state brings back the epoch's order but leaves the loader's
                # generators elsewhere than the interrupted run had them: the next epochs'
                # orders come from the states they had at the checkpoint.
                for k, g in enumerate(self.generators):
                    g.set_state(pending["tensors"][f"now.{k}"])
            return it, 0
        it = iter(loader)
        if not skip:
            return (fast_batches(loader, it) if self.kind == "sampled" else None) or it, 0
        if self.kind == "sampled":
            if loader.num_workers > 0 or not hasattr(it, "_next_index"):
                return it, skip  # read and dropped after the generators are back (epoch())
            try:
                for _ in range(skip):  # index lists only: no item of the done batches is read
                    it._next_index()
            except StopIteration:
                return iter(()), 0
            return fast_batches(loader, it) or it, 0
        for _ in range(skip):  # replay: read and drop what the interrupted run did
            if next(it, _END) is _END:
                break
        return it, 0

    # ---------------------------------------------------------------- position
    def state(self) -> Optional[dict]:
        """What a checkpoint records of the loader now (called when one is written)."""
        if self.kind == "leantrain":
            return self.at_start.state()
        if self.epoch_rng is None:
            return None
        glob, gens = self.epoch_rng
        tensors = {"global": glob, **{f"generator.{k}": s for k, s in enumerate(gens)}}
        out = {"kind": self.kind, "generators": len(gens), "tensors": tensors}
        if self.kind in ("stateful", "iterable"):
            source = self.loader if self.kind == "stateful" else self.loader.dataset
            out["state"] = encode(source.state_dict(), tensors)
        if self.kind == "stateful":
            tensors.update({f"now.{k}": g.get_state() for k, g in enumerate(self.generators)})
        return out

    def problems(self, saved: Optional[dict]) -> list[str]:
        """Why ``saved`` (a checkpoint's loader record) cannot resume this loader."""
        if self.kind == "leantrain":
            if not isinstance(saved, dict) or "order" not in saved or "kind" in saved:
                return ["the checkpoint has no leantrain DataLoader state"]
            try:
                self.loader.restored(saved, self.op)
            except DataError as e:
                return [str(e).removeprefix(f"{self.op}: ")]
            return []
        if saved is None:
            return []  # an older checkpoint without a loader position: resumed, with a warning
        got = saved.get("kind") if isinstance(saved, dict) else None
        if got != self.kind:
            return [f"loader: the checkpoint was written with a {got or 'leantrain DataLoader'!s} loader, "
                    f"this run's is {self.kind} ({type(self.loader).__name__})"]
        if saved.get("generators") != len(self.generators):
            return [f"loader: the checkpoint's loader drew from {saved.get('generators')!r} generator(s), "
                    f"this one draws from {len(self.generators)}"]
        if self.kind in ("stateful", "iterable"):
            if not saved.get("state"):
                return [f"loader: the checkpoint's {self.kind} loader state is empty (a resume would silently "
                        f"start the epoch over)"]
            return self._state_refused(saved)
        return []

    def position_problems(self, progress: dict) -> list[str]:
        """Why a checkpoint's position cannot be in this loader: more batches done in its
        epoch than one pass of the loader has (where its length is known)."""
        batch, length = progress.get("batch"), _length(self.loader)
        if isinstance(batch, int) and batch > length:
            return [f"progress.batch: {batch} batches done in epoch {progress.get('epoch')}, but one pass of this "
                    f"loader has {length}"]
        return []

    def _state_refused(self, saved: dict) -> list[str]:
        """Whether the loader (or its dataset) takes the saved state: tried before anything
        is installed, then its own state put back (a refused resume leaves it as found)."""
        target = self.loader if self.kind == "stateful" else self.loader.dataset
        try:
            mine = target.state_dict()
        except Exception as e:  # the user's loader code
            return [f"loader: its state_dict() raised {type(e).__name__}: {e}"]
        try:
            target.load_state_dict(decode(saved.get("state"), saved.get("tensors", {})))
            if self.kind == "stateful" and getattr(target, "num_workers", 1) == 0:
                with rng_preserved(torch.device("cpu"), self.generators):
                    iter(target)  # torchdata applies (and checks) a state when an iterator starts
        except Exception as e:  # torch's or torchdata's own checks, or the dataset's
            return [f"loader: {type(target).__name__}.load_state_dict refused the checkpoint's state "
                    f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"]
        finally:
            try:
                target.load_state_dict(mine)
            except Exception:  # its own state, taken a moment ago: nothing better to put back
                pass
        return []

    def restore(self, saved: Optional[dict], epoch: int, skip: int) -> None:
        """Put the checkpoint's position in place for the resumed epoch (checked by
        ``problems`` first); warn once when it cannot be put back exactly."""
        if self.kind == "leantrain":
            self.loader = self.at_start = self.loader.restored(saved, self.op)
            return
        self.pending = saved
        reason = self.inexact(skip) if saved is not None else (
            f"the checkpoint holds no position for this loader (written by an older leantrain): the "
            f"{skip} batch(es) done are skipped from a fresh pass, whose order may differ" if skip else None)
        if reason and not self.warned:
            self.warned = True
            warnings.warn(f"{self.op}: resuming in epoch {epoch} after {skip} batch(es): {reason}", stacklevel=4)

    def inexact(self, skip: int) -> Optional[str]:
        """Why a resume may not give the interrupted run's batches (``None``: it does)."""
        if self.kind == "replay" and skip and not isinstance(self.loader, (list, tuple)):
            return (f"a {type(self.loader).__name__} has no position to save, so the {skip} batch(es) done "
                    f"are read again and dropped; the run continues exactly only if the loader yields the "
                    f"same batches in the same order again")
        if self.kind == "sampled" and self.loader.num_workers > 0 and self.loader.persistent_workers:
            return ("persistent workers carry their random state from epoch to epoch, and the resumed "
                    "run's workers start from their seeds: what the dataset draws in the workers may differ")
        return None

    # --------------------------------------------------------------- measuring
    def measurable(self) -> bool:
        """Whether a measuring pass can read the loader without changing what training
        reads: an in-memory loader, or a torch DataLoader over a map-style dataset (its
        generators are put back after the pass)."""
        return self.kind in ("leantrain", "sampled") or isinstance(self.loader, (list, tuple))

    def samples(self, limit: Optional[int]) -> Iterator:
        """The samples of one measuring pass over at most ``limit`` batches (``None``: a
        whole pass), read lazily; a leantrain loader's in stored order."""
        if self.kind == "leantrain":
            return self.loader.iter_items(self.op, limit)
        source = (fast_batches(self.loader) if plain_tensor_loader(self.loader) else None) or iter(self.loader)
        return (s for raw in _first(source, limit) for s in as_list_batch(self.op, raw))

    def size(self) -> Optional[int]:
        """Items in one pass where known without reading (a checkpoint's ``n_samples``):
        a leantrain loader's dataset items (before any collate: the same on every rank),
        a sized torch loader's batches, a list's items."""
        if self.kind == "leantrain":
            return len(self.loader.dataset)
        if isinstance(self.loader, (list, tuple)):
            return sum(len(as_list_batch(self.op, b)) for b in self.loader)
        try:
            return len(self.loader)
        except TypeError:
            return None  # an IterableDataset without __len__: unknown, never counted


_END = object()


def _length(loader: object) -> float:
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
