"""Whether a schedule indexed by epoch (a loader loop's ``schedule_per="epoch"``, upstream's
rule) does what its horizon says: checked when the config is built."""

from __future__ import annotations

from typing import Optional

from ...errors import ConfigError


def check_epoch_indexing(op: str, scheduler, epochs: Optional[int], schedule_per: str) -> None:
    """Refuse a schedule that, indexed by epoch, would run at one rate throughout (one
    epoch) or never leave its warm-up (a horizon counted in updates)."""
    if schedule_per != "epoch":
        return
    if epochs == 1 and epoch_schedule_varies(scheduler):
        raise ConfigError(
            f"{op}: schedule_per='epoch' with epochs=1: the schedule's index is the epoch, which stays 0 for "
            f"the whole run (every update at the rate {scheduler.lr_at(0)!r}); set schedule_per='step' to "
            f"schedule over updates, or drop the scheduler")
    peak = unreached_peak(scheduler, epochs)
    if peak is not None:  # a horizon counted in updates, indexed by epoch: a whole epoch at each warm-up rate
        raise ConfigError(
            f"{op}: schedule_per='epoch' indexes the schedule by epoch (0..{epochs - 1}), but it rises to "
            f"{peak[1]!r} only at index {peak[0]}: the run would never leave its warm-up (its horizon counts "
            f"updates, as transformers' and warmup schedules do); set schedule_per='step' to schedule over "
            f"updates")


def unreached_peak(scheduler, epochs: Optional[int]) -> Optional[tuple]:
    """``(index, rate)`` where one of leantrain's schedules, indexed by epoch, peaks above
    every rate its ``epochs`` indices give, or ``None`` (it peaks within them; a plateau
    schedule; a schedule class of the user's, which is not probed)."""
    if scheduler is None or epochs is None or epochs < 2 or getattr(scheduler, "fed_by_evaluations", False):
        return None
    if not type(scheduler).__module__.startswith("leantrain."):
        return None  # a schedule of the user's own: its rates are asked by the loop only
    reached = max(scheduler.lr_at(t) for t in range(min(epochs, 4096)))
    later = [(scheduler.lr_at(t), -t) for t in {epochs, epochs + 1, 2 * epochs, 4 * epochs, 8, 16, 32, 64, 128,
                                                 256, 1024} if t >= epochs]
    rate, t = max(later)
    return (-t, rate) if rate > reached else None


def epoch_schedule_varies(scheduler) -> bool:
    """Whether a schedule indexed by epoch gives another rate after index 0 (a plateau
    schedule, fed by evaluations, is not indexed)."""
    if scheduler is None or getattr(scheduler, "fed_by_evaluations", False):
        return False
    first = scheduler.lr_at(0)
    return any(scheduler.lr_at(t) != first for t in (1, 2, 3, 10, 100, 1000))
