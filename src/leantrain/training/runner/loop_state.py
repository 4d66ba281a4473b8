"""A loop's state, in one typed home, and the runner's public work counters.

A loop installs a ``LoopState`` on its runner for its length (``Runner.looping``) and
the runner puts back what was there when the loop ends, even when it raised:

* ``amp`` / ``loss_scale``: mixed precision (``precision.py``): the autocast dtype and
  the float16 loss scale, a device tensor each loss is multiplied by;
* ``compiled``: the compiled loss of a ``compile=True`` loop (``compiled.py``);
* ``steady``: what the steps check once and reuse while no user code runs
  (``Runner.steady``, ``Runner.recheck``).

Nothing else writes these fields: the modules that compute them return values the loop
puts in the record. ``RunnerStats`` counts the work a runner did (bindings, layouts,
buffer passes), so tests and benchmarks observe the "checked once per loop" saving
without patching private functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch


@dataclass
class Steady:
    """What a loop's steps checked at the first step and reuse until ``recheck()``."""

    checked: Any = None  # the optimizer whose state the first step checked
    slot_map: Optional[list] = None  # params.canonical_slot_indices()
    plain: Optional[bool] = None  # that map is the identity (no tie, nothing frozen)
    binding: Any = None  # a Binding that swaps nothing in (reused as it is)
    layout: Any = None  # the optimizer's update layout (optim.layout.Layout)
    buckets: Any = None  # data parallel's bucket plan (overlap.BucketPlan)
    # What the module and slots looked like when the above were checked
    # (``ModuleView.fingerprint``), and whether user code ran since (``Runner.user_code_ran``).
    fingerprint: Optional[list] = None
    suspect: bool = False
    # one process: the last update's gradients, let go when the next update begins (as a hand
    # loop's ``zero_grad(set_to_none=True)`` lets its ``.grad`` go), so the allocator reuses
    # their memory for the next forward instead of returning it to the system and faulting it in
    held: Any = None

    def clear(self) -> None:
        self.checked = self.slot_map = self.plain = self.binding = self.layout = self.buckets = self.fingerprint = None
        self.suspect = False


@dataclass
class LoopState:
    """What one loop installs on its runner (``Runner.looping``)."""

    amp: Optional[torch.dtype] = None
    loss_scale: Optional[torch.Tensor] = None
    compiled: Optional[Callable] = None
    steady: Optional[Steady] = None


@dataclass
class RunnerStats:
    """What a runner did, counted since it was built (``runner.stats``; read, never
    needed for training). ``bindings``: module bindings built (each checks that the
    module still holds the slots' objects); ``layouts``: optimizer update layouts built
    by steps (each validates the slots, gradients and records); ``buffer_passes``: no-
    gradient forward passes over a batch that let the buffers advance first;
    ``redone_steps``: steps redone with that pass because the model was first seen
    writing a buffer; ``draw_counts``: no-gradient forwards that counted how far an item
    shape's forward moves the generators (data parallel, ``draw_shift.py``)."""

    bindings: int = 0
    layouts: int = 0
    buffer_passes: int = 0
    redone_steps: int = 0
    draw_counts: int = 0
