"""The engine a run's ranks train with: leantrain's own, or torch's ``DistributedDataParallel``
or ``fully_shard`` (FSDP2).

``engine="leantrain"`` (the default) is leantrain's data parallel and ``sharding=`` modes:
one process's bits on any number of ranks with ``exact_reduction``. ``engine="ddp"`` (or
``DDP(...)``, its options) hands the gradient all-reduce to torch's
``DistributedDataParallel``, the engine a cluster's profilers and NCCL tuning are built
around: its buckets, its hooks on the backward, its ``no_sync`` for every item of a rank's
share but the last. The loop's contract stays leantrain's (items, the ``1/n`` mean, ties
updated once, frozen slots, evaluation, checkpoints); the bits across world sizes are
given up: a rank's items are summed first, then the ranks' sums by the collective.
``engine="fsdp2"`` (or ``FSDP2(...)``) runs the forwards and backwards through torch's
``fully_shard`` (its all-gathers and reduce-scatters, its mixed precision) on a working copy
of the module, and leantrain's optimizer steps each rank's FSDP2 shard in place
(``torch_fsdp2.py``); the same contract, the same bits given up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from ...errors import ConfigError
import torch

from ...validate import check_bool

ENGINES = ("leantrain", "ddp", "fsdp2")


@dataclass(frozen=True)
class DDP:
    """torch's ``DistributedDataParallel`` as the run's engine (``engine=lt.DDP()``, or
    ``engine="ddp"`` for these defaults), with torch's own option names:
    ``bucket_cap_mb`` (``None``: torch's 25 MB), ``find_unused_parameters`` (a model whose
    forward leaves some trainable parameter unused in an item must say ``True``, as with
    torch) and ``gradient_as_bucket_view``. (torch's ``static_graph`` is not offered: with
    ``no_sync`` over a rank's items it fails inside DDP's reducer.) leantrain wraps the trained
    parameters for the run and hands back the module as it was: never wrap it yourself."""

    bucket_cap_mb: Optional[float] = None
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False

    name = "ddp"

    def __post_init__(self) -> None:
        for flag in ("find_unused_parameters", "gradient_as_bucket_view"):
            check_bool("DDP", flag, getattr(self, flag))
        cap = self.bucket_cap_mb
        if cap is not None and not (isinstance(cap, (int, float)) and not isinstance(cap, bool) and 0 < cap < 10**6):
            raise ConfigError(f"DDP: bucket_cap_mb must be megabytes > 0 or None (torch's 25), got {cap!r}")


FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class FSDP2:
    """torch's ``fully_shard`` (FSDP2) as the run's engine (``engine=lt.FSDP2()``, or
    ``engine="fsdp2"`` for these defaults), with torch's own option names:
    ``param_dtype`` and ``reduce_dtype`` (its ``MixedPrecisionPolicy``: the dtype the
    parameters are gathered in for the forward, and the gradients reduce-scattered in;
    ``None``: the parameters' own), ``reshard_after_forward`` (free a unit's gathered
    parameters after its forward, gather again for its backward) and ``cpu_offload``
    (its ``CPUOffloadPolicy``: the shards, their gradients and the optimizer's step in host
    memory). The units are those ``sharding="parameters"`` gathers (``shard_units``: every
    element of an ``nn.ModuleList`` by default), the root last. leantrain shards a working
    copy of the module for the run and hands back the module as it was, with the trained
    values in its own Parameters: never call ``fully_shard`` on it yourself."""

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    reshard_after_forward: bool = True
    cpu_offload: bool = False

    name = "fsdp2"

    def __post_init__(self) -> None:
        for flag in ("reshard_after_forward", "cpu_offload"):
            check_bool("FSDP2", flag, getattr(self, flag))
        for field in ("param_dtype", "reduce_dtype"):
            d = getattr(self, field)
            if d is not None and d not in FLOATS:
                raise ConfigError(f"FSDP2: {field} must be a floating-point torch.dtype ({', '.join(map(str, FLOATS))})"
                                  f" or None, got {d!r:.60}")


Engine = Union[str, DDP, FSDP2]


def engine_of(op: str, value) -> Union[str, DDP, FSDP2]:
    """``value`` as the config holds it: ``"leantrain"``, a ``DDP`` or an ``FSDP2`` record
    (``"ddp"`` becomes ``DDP()``, ``"fsdp2"`` ``FSDP2()``); anything else refused naming the choices."""
    if isinstance(value, (DDP, FSDP2)):
        return value
    if value == "leantrain":
        return value
    if value == "ddp":
        return DDP()
    if value == "fsdp2":
        return FSDP2()
    raise ConfigError(f"{op}: engine must be one of {ENGINES}, a leantrain.DDP(...) or a leantrain.FSDP2(...), "
                      f"got {value!r:.60}")


def torch_engine(engine) -> bool:
    """Whether ``engine`` hands the reduction to torch (not leantrain's own)."""
    return not isinstance(engine, str)


__all__ = ["DDP", "ENGINES", "FSDP2", "Engine", "engine_of", "torch_engine"]
