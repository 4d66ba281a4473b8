"""What a loop reports after each update."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ...optim import OptState


@dataclass(frozen=True)
class StepEvent:
    """What a callback sees after each update. ``loss`` is set on logged steps only.

    ``step`` counts updates completed so far (from 1); the log line of that same
    update reads ``step {step - 1}`` (the index of the update, from 0, as upstream)."""

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
