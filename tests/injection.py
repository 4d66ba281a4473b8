"""A run killed at an explicit point: the step callback raises after update ``step`` (no
sleeps, no random kill times), the way the resume tests stop a run mid-way."""

from __future__ import annotations

from typing import Callable, Optional


def kill_at(step: Optional[int]) -> Callable:
    """A step callback that interrupts the run after update ``step`` (``None``: never)."""
    def killer(event):
        if event.step == step:
            raise KeyboardInterrupt

    return killer


def unless_killed(train: Callable):
    """``train()``'s result, or ``None`` when the injected kill interrupted it."""
    try:
        return train()
    except KeyboardInterrupt:
        return None
