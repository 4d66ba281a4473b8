"""The optimizer applied to an update's mean gradients: clipping, skip mode, the loss scale.

``clipped`` clips the canonical gradients (each storage once, a tie with its sum) as the
options ask and returns the norm before clipping; ``apply`` runs the optimizer's update
(its fused kernels) and, in skip mode, undoes it on the device where the non-finite flag
is set, the buffers too. Nothing here reads a tensor back to the host. One process and
data parallel apply this way; sharding applies to its ranges (``parallel/sharding``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...optim import OptState, Optimizer
from ...optim.clipping import clip_
from ...params.packs import canonical_gradients
from ..runner.binding import BufferSnapshot
from ..runner.runner import Runner
from .mean import Pack
from .options import StepOptions


def clipped(runner: Runner, grads: Pack, o: StepOptions) -> tuple[Pack, Optional[torch.Tensor]]:
    """The gradients clipped as ``o`` asks, on the canonical gradients (each storage once,
    a tie with its sum), and the norm before clipping (clipping by norm); else as given."""
    if not o.clipping:
        return grads, None
    grads = canonical_gradients(runner.slot_map(), grads, allow_missing=True)
    return grads, clip_(grads, o.clip_grad_norm, o.clip_grad_value)


def apply(runner: Runner, opt: Optimizer, state: OptState, grads: Pack, found: torch.Tensor,
          snapshot: Optional[BufferSnapshot], o: StepOptions) -> OptState:
    """The optimizer's update; in skip mode undone on the device where ``found`` is set
    (the buffers too), the skip counted, the loss scale adjusted. No host read."""
    skipping(found, snapshot, o)
    steady = runner.loop.steady
    kept = None if steady is None else steady.layout
    # The gradients come from the runner's own slots: their shapes and dtypes fit.
    state = opt.apply(state, runner.params, grads, o.path, found_inf=found if o.skips else None,
                      presummed=o.clipping, cache=steady, slots_map=runner.slot_map())
    if steady is None or steady.layout is None or steady.layout is not kept:
        runner.counted_layout()
    if o.scaler is not None:
        o.scaler.update(found)
    return state


def skipping(found: torch.Tensor, snapshot: Optional[BufferSnapshot], o: StepOptions) -> None:
    """Skip mode: the buffers put back where ``found`` is set, the skip counted."""
    if o.skips:
        if snapshot is not None:
            snapshot.restore_where(found)  # a skipped step leaves the buffers as they were
        if o.skipped is not None:
            o.skipped.add_(found[0])
