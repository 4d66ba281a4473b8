"""The kinds of loader the loader loop reads, each a ``Stream`` (``streams.py``), and
``stream_of``, which picks one: lazily, one pass per epoch, its position saved in
checkpoints and put back exactly where the loader allows it.

Nothing is read ahead, counted or kept: a pass yields the loader's batches as they come
(the torch DataLoader's own prefetch is the only read-ahead), so memory does not grow
with the dataset and a loader without ``len()`` (an endless stream) trains. Each kind of
loader is a class behind one interface (``Stream``: ``epoch``, ``state``, ``problems``,
``restore``, ``measurable``), chosen once per loop by ``stream_of``:

* ``LeantrainStream``: a ``leantrain.DataLoader``; its seeded order is its position.
* ``SampledStream``: a ``torch.utils.data.DataLoader`` over a map-style dataset. An
  epoch's order is drawn when its iterator starts (the sampler's shuffle, the workers'
  base seed), from the loader's and the samplers' generators, or the global generator
  where they have none. Their states at the start of the current epoch are the
  position; a resume puts them back, starts the epoch's iterator as the interrupted run
  did, and skips the batches done by their index lists, reading no data (with
  ``num_workers > 0`` the workers read and drop them, so what the dataset draws in the
  workers replays).
* ``StatefulStream``: a loader with ``state_dict``/``load_state_dict`` (torchdata's
  ``StatefulDataLoader``): its own state is the position.
* ``IterableStream``: a torch DataLoader without workers over an ``IterableDataset``
  that has ``state_dict``/``load_state_dict``: the dataset's state is the position.
* ``ReplayStream``: anything else. A list or tuple of batches is read again exactly; any
  other iterable (a plain ``IterableDataset``) is resumed by reading and dropping the
  batches done, with a warning that says so.

Samplers with ``set_epoch`` (``DistributedSampler``) are told each epoch's number first.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from ..runner.binding import rng_preserved
from ...data import DataLoader, dataset_length
from ...errors import DataError
from ...io.nested import decode, encode
from .batches import fast_batches
from .streams import Stream, TorchStream, length_of


def _torch_loader(loader: object) -> bool:
    return isinstance(loader, torch.utils.data.DataLoader)


def _map_style(loader: object) -> bool:
    return _torch_loader(loader) and not isinstance(loader.dataset, torch.utils.data.IterableDataset)


def _has_state(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def stream_of(op: str, loader: object) -> "Stream":
    """The stream for ``loader``: its kind decided once, here."""
    if isinstance(loader, DataLoader):
        return LeantrainStream(op, loader)
    if _has_state(loader) and _map_style(loader) and loader.num_workers > 0:
        # torchdata's StatefulDataLoader with workers: its state fast-forwards the sampler but
        # not the workers' generators, so random augmentation would draw other numbers after
        # a resume. Replayed as a torch loader instead: the epoch's generators put back and
        # the batches done read (by the workers) and dropped, so the workers draw as before.
        return SampledStream(op, loader)
    if _has_state(loader):
        return StatefulStream(op, loader)
    if _map_style(loader):
        return SampledStream(op, loader)
    if _torch_loader(loader) and loader.num_workers == 0 and _has_state(loader.dataset):
        return IterableStream(op, loader)
    return ReplayStream(op, loader)


class LeantrainStream(Stream):
    """A ``leantrain.DataLoader``: its seeded order (kept in the loader) is its position."""

    kind = "leantrain"

    def __init__(self, op: str, loader: DataLoader) -> None:
        super().__init__(op, loader)
        self.at_start = loader  # the loader as it was when the epoch began

    def epoch(self, epoch: int, skip: int) -> Iterator:
        self.at_start = self.loader
        self.loader, batches = self.loader.epoch_batches(self.op, skip)
        return batches

    def state(self) -> Optional[dict]:
        return dict(self.at_start.state(), workers=self.loader.num_workers > 0)

    def problems(self, saved: Optional[dict]) -> list[str]:
        if not isinstance(saved, dict) or "order" not in saved or "kind" in saved:
            return ["the checkpoint has no leantrain DataLoader state"]
        try:
            self.loader.restored(saved, self.op)
        except DataError as e:
            return [str(e).removeprefix(f"{self.op}: ")]
        return []

    def restore(self, saved: Optional[dict], epoch: int, skip: int) -> None:
        self.loader = self.at_start = self.loader.restored(saved, self.op)
        self._warn_workers(saved, self.loader.num_workers > 0, "each item's generators are seeded from the "
                           "loader's seed and the item with workers, but draw from the main process's global "
                           "generator without")

    def measurable(self) -> bool:
        return True

    def samples(self, limit: Optional[int]) -> Iterator:
        return self.loader.iter_items(self.op, limit)  # in stored order

    def size(self) -> Optional[int]:
        return len(self.loader.dataset)  # the dataset's items (before any collate: the same on every rank)


class SampledStream(TorchStream):
    """A torch DataLoader over a map-style dataset (see the module docstring)."""

    kind = "sampled"

    def __init__(self, op: str, loader: object) -> None:
        super().__init__(op, loader)
        self.length = dataset_length(op, loader.dataset)  # checked once: a length torch's sampler can use

    def start(self, pending: Optional[dict], skip: int) -> tuple[Iterator, int]:
        loader = self.loader
        n = dataset_length(self.op, loader.dataset)
        if n != self.length:
            raise DataError(f"{self.op}: the dataset's length changed from {self.length} to {n} between epochs (a "
                            f"dataset read by index must keep its items: the sampler's order and a resume's "
                            f"position depend on them)")
        it = iter(loader)
        if not skip:
            return fast_batches(loader, it) or it, 0
        if loader.num_workers > 0 or not hasattr(it, "_next_index"):
            return it, skip  # read and dropped after the generators are back (epoch())
        try:
            for _ in range(skip):  # index lists only: no item of the done batches is read
                it._next_index()
        except StopIteration:
            return iter(()), 0
        return fast_batches(loader, it) or it, 0

    def state(self) -> Optional[dict]:
        out = super().state()
        return None if out is None else dict(out, workers=self.loader.num_workers > 0)

    def restore(self, saved: Optional[dict], epoch: int, skip: int) -> None:
        super().restore(saved, epoch, skip)
        self._warn_workers(saved, self.loader.num_workers > 0, "the dataset draws in worker processes seeded "
                           "per epoch with workers, from the main process's global generator without")

    def inexact(self, skip: int) -> Optional[str]:
        if self.loader.num_workers > 0 and self.loader.persistent_workers:
            return ("persistent workers carry their random state from epoch to epoch, and the resumed "
                    "run's workers start from their seeds: what the dataset draws in the workers may differ")
        return None

    def measurable(self) -> bool:
        return True


class StatefulStream(TorchStream):
    """A loader with its own ``state_dict``/``load_state_dict`` (torchdata's
    ``StatefulDataLoader``): its state is the position; the generators' states at the
    checkpoint ride along, for the epochs after the resumed one."""

    kind = "stateful"

    def target(self):
        """What holds the state (the loader)."""
        return self.loader

    def put_back_generators(self, saved: dict) -> None:
        return None  # the loader's own state brings its generators back

    def start(self, pending: Optional[dict], skip: int) -> tuple[Iterator, int]:
        if pending is None:
            return super().start(pending, skip)
        self.target().load_state_dict(decode(pending["state"], pending.get("tensors", {})))
        it = iter(()) if skip >= length_of(self.loader) else iter(self.loader)  # continues after the batches done
        # torchdata's state brings back the epoch's order but leaves the loader's generators
        # elsewhere than the interrupted run had them: the next epochs' orders come from the
        # states they had at the checkpoint.
        for k, g in enumerate(self.generators):
            g.set_state(pending["tensors"][f"now.{k}"])
        return it, 0

    def state(self) -> Optional[dict]:
        out = super().state()
        if out is not None:
            out["state"] = encode(self.target().state_dict(), out["tensors"])
            out["tensors"].update({f"now.{k}": g.get_state() for k, g in enumerate(self.generators)})
        return out

    def problems(self, saved: Optional[dict]) -> list[str]:
        found = super().problems(saved)
        if found or saved is None:
            return found
        if not saved.get("state"):
            return [f"loader: the checkpoint's {self.kind} loader state is empty (a resume would silently "
                    f"start the epoch over)"]
        return self._state_refused(saved)

    def _state_refused(self, saved: dict) -> list[str]:
        """Whether the loader (or its dataset) takes the saved state: tried before anything
        is installed, then its own state put back (a refused resume leaves it as found)."""
        target = self.target()
        try:
            mine = target.state_dict()
        except Exception as e:  # the user's loader code
            return [f"loader: its state_dict() raised {type(e).__name__}: {e}"]
        try:
            target.load_state_dict(decode(saved.get("state"), saved.get("tensors", {})))
            if target is self.loader and getattr(target, "num_workers", 1) == 0:
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


class IterableStream(StatefulStream):
    """A torch DataLoader without workers over an ``IterableDataset`` with a state: the
    dataset's state is the position (its generators are the loader's, put back)."""

    kind = "iterable"

    def target(self):
        return self.loader.dataset

    def put_back_generators(self, saved: dict) -> None:
        TorchStream.put_back_generators(self, saved)

    def start(self, pending: Optional[dict], skip: int) -> tuple[Iterator, int]:
        if pending is None:
            return TorchStream.start(self, pending, skip)
        self.target().load_state_dict(decode(pending["state"], pending.get("tensors", {})))
        return (iter(()) if skip >= length_of(self.loader) else iter(self.loader)), 0

    def state(self) -> Optional[dict]:
        out = TorchStream.state(self)
        if out is not None:
            out["state"] = encode(self.target().state_dict(), out["tensors"])
        return out


class ReplayStream(TorchStream):
    """Anything else: a list of batches, or an iterable re-read and dropped up to a
    resume's position."""

    kind = "replay"

    def inexact(self, skip: int) -> Optional[str]:
        if skip and not isinstance(self.loader, (list, tuple)):
            return (f"a {type(self.loader).__name__} has no position to save, so the {skip} batch(es) done "
                    f"are read again and dropped; the run continues exactly only if the loader yields the "
                    f"same batches in the same order again")
        return None


