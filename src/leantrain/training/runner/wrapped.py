"""A module already wrapped by a distributed engine, refused before a Runner reads it.

leantrain applies torch's engines itself (``engine="ddp"``, ``"fsdp2"``): the user hands over the plain
module. A module someone already wrapped would otherwise be trained beside its wrapper:
a ``DistributedDataParallel`` inert until its own collectives hang an uneven update,
``fully_shard``'s DTensor parameters read as one address (no storage of their own), a
DeepSpeed ZeRO-3 module's parameters shaped ``(0,)``. Each is named, with the fix, before
anything runs. DeepSpeed is recognised by its names (``DeepSpeedEngine``, ZeRO-3's ``ds_id``
on a parameter), without importing it.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from ...errors import ConfigError

PLAIN = ("pass the plain module (the one you built) and choose the engine with engine='ddp' or 'fsdp2' (or the "
         "default 'leantrain')")


def _class_names(obj) -> set:
    return {c.__name__ for c in type(obj).__mro__}


def wrapper_of(module: nn.Module) -> Optional[str]:
    """What wraps ``module`` (a sentence naming it and the way out), or ``None``."""
    names = _class_names(module)
    if "DeepSpeedEngine" in names:
        return ("a DeepSpeedEngine: DeepSpeed takes over the whole update (its optimizer, its ZeRO partitions), "
                "so it is not an engine leantrain can run; pass the plain module you gave deepspeed.initialize, "
                "with engine='ddp' or sharding= for ZeRO")
    for kind in ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel"):
        if kind in names:
            return f"torch's {kind} wrapper: {PLAIN}; leantrain applies torch's engine for the run itself"
    for name, sub in module.named_modules():
        if "FSDPModule" in _class_names(sub):
            return (f"wrapped by torch's fully_shard (FSDP2) at {name or 'the root'!r}: {PLAIN}; with "
                    f"engine='fsdp2' leantrain applies fully_shard to a copy for the run itself")
    for name, p in module.named_parameters(remove_duplicate=False):
        if "DTensor" in _class_names(p):
            return (f"holding DTensor parameters ({name!r}: from fully_shard or parallelize_module): leantrain trains "
                    f"plain tensors; {PLAIN}")
        if hasattr(p, "ds_id") or hasattr(p, "ds_status"):
            return (f"a DeepSpeed ZeRO-3 module ({name!r} is partitioned: shape {tuple(p.shape)} here, "
                    f"{getattr(p, 'ds_numel', '?')} elements in DeepSpeed's partitions): DeepSpeed is not an engine "
                    f"leantrain runs (it takes over the whole update); pass the plain module, built without "
                    f"deepspeed.zero.Init, with engine='ddp' or sharding='parameters'")
    return None


def refuse_wrapped(op: str, module) -> None:
    """``ConfigError`` for a module already wrapped by a distributed engine (nothing read yet)."""
    if not isinstance(module, nn.Module):
        return  # the Runner's own checks name what it is
    why = wrapper_of(module)
    if why is not None:
        raise ConfigError(f"{op}: the module is {why}")


__all__ = ["refuse_wrapped", "wrapper_of"]
