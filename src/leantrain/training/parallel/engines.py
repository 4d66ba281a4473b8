"""The engine a run's ranks train with: leantrain's own, or torch's ``DistributedDataParallel``.

``engine="leantrain"`` (the default) is leantrain's data parallel and ``sharding=`` modes:
one process's bits on any number of ranks with ``exact_reduction``. ``engine="ddp"`` (or
``DDP(...)``, its options) hands the gradient all-reduce to torch's
``DistributedDataParallel``, the engine a cluster's profilers and NCCL tuning are built
around: its buckets, its hooks on the backward, its ``no_sync`` for every item of a rank's
share but the last. The loop's contract stays leantrain's (items, the ``1/n`` mean, ties
updated once, frozen slots, evaluation, checkpoints); the bits across world sizes are
given up: a rank's items are summed first, then the ranks' sums by the collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from ...errors import ConfigError
from ...validate import check_bool

ENGINES = ("leantrain", "ddp")


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


Engine = Union[str, DDP]


def engine_of(op: str, value) -> Union[str, DDP]:
    """``value`` as the config holds it: ``"leantrain"`` or a ``DDP`` record (``"ddp"``
    becomes ``DDP()``); anything else refused naming the choices."""
    if isinstance(value, DDP):
        return value
    if value == "leantrain":
        return value
    if value == "ddp":
        return DDP()
    if value == "fsdp2":
        raise ConfigError(f"{op}: engine='fsdp2' (torch's fully_shard) is not built yet; use engine='ddp' for "
                          f"torch's DistributedDataParallel or sharding='parameters' (leantrain's ZeRO-3)")
    raise ConfigError(f"{op}: engine must be one of {ENGINES} or a leantrain.DDP(...), got {value!r:.60}")


def torch_engine(engine) -> bool:
    """Whether ``engine`` hands the reduction to torch (not leantrain's own)."""
    return not isinstance(engine, str)


__all__ = ["DDP", "ENGINES", "Engine", "engine_of", "torch_engine"]
