"""What a loop reports after each update, and where a run stands.

One numbering: an update is numbered from 1 (the first update is update 1), in the
console's ``step N`` lines, ``StepEvent.step``, the metrics files, ``TrainReport`` and
checkpoints. "Step" means an optimizer update and nothing else; a loader's batches, an
update's items and an epoch's position have their own names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ...optim import OptState


@dataclass(frozen=True)
class StepEvent:
    """What a callback sees after each update. ``loss`` is set on logged updates only.

    ``step``: the update's number, counted from 1 (the updates done so far); its log
    line reads ``step {step}: loss=...``."""

    step: int
    state: OptState
    loss: Optional[float] = None
    epoch: Optional[int] = None
    batch: Optional[int] = None  # batches completed in this epoch (loaders)
    grad_norm: Optional[float] = None  # the norm before clipping, on logged steps with clip_grad_norm
    # On logged steps: samples_per_s, and for token data tokens_per_s and (with a known peak) mfu,
    # over the updates since the previous logged one (throughput.py).
    throughput: Optional[dict] = None


# A callback returning True asks the loop to stop after this step (saving a checkpoint
# when one is configured); the CLI uses it for Ctrl-C, progress bars and metrics.
StepCallback = Callable[[StepEvent], Optional[bool]]


@dataclass(frozen=True)
class Progress:
    """Where a run stands after an update: ``step`` updates done (counted from 1 as the
    updates are numbered), and for a loader loop its epoch (from 0), the loader batches
    done in that epoch and the items seen (what a checkpoint saves and a resume starts at).
    An in-memory loop has no epoch (``None``)."""

    step: int = 0
    epoch: Optional[int] = None
    batch: Optional[int] = None
    seen: int = 0

    def after(self, batch: int, items: int) -> "Progress":
        """One update later, at loader batch ``batch`` of the epoch, ``items`` more seen."""
        return Progress(self.step + 1, self.epoch, batch, self.seen + items)

    def next_epoch(self) -> "Progress":
        return Progress(self.step, self.epoch + 1, 0, self.seen)

    def record(self) -> dict:
        """The fields a checkpoint's progress holds besides the step (a loader's)."""
        return {} if self.epoch is None else {"epoch": self.epoch, "batch": self.batch, "seen": self.seen}
