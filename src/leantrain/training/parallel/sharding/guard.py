"""The guard of a parameter-sharded run's first update (``ParameterShards.guarded``): a
torch call that reads a released Parameter outside its unit's forward is refused with
the slot named, rather than reading memory that is not there."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from ....errors import ConfigError


# calls that read a tensor's description, never its memory (a property, its size, a detached alias);
# and the backward's entry points (``torch.autograd.grad``, which the step calls on a GPU, names
# the Parameters as the inputs to differentiate: the backward's hooks gather each unit it reads)
METADATA = frozenset({"__get__", "__set__", "size", "dim", "stride", "numel", "data_ptr", "untyped_storage",
                       "storage_offset", "is_contiguous", "element_size", "detach", "requires_grad_",
                       "register_hook", "empty_like", "__len__", "grad", "backward"})


class Guard(TorchFunctionMode):
    """Refuses a torch call that reads a released Parameter (see ``ParameterShards.guarded``)."""

    def __init__(self, shards, op: str) -> None:  # shards: a ParameterShards
        super().__init__()
        self.shards, self.op = shards, op
        self.ids = {id(shards.full[c]): c for c in shards.sharded}

    def _check(self, x) -> None:
        if isinstance(x, torch.Tensor):
            c = self.ids.get(id(x))
            if c is not None and not self.shards.resident[c]:
                raise ConfigError(
                    f"{self.op}: sharding='parameters': slot {c} ({self.shards.names[c]}) was read outside the "
                    f"forward of the module that holds it, where its memory is released; use the parameter only "
                    f"inside its own module's forward (or wrap the use in a module), or shard 'gradients'")
        elif isinstance(x, (list, tuple)):
            for y in x:
                self._check(y)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in METADATA:
            return func(*args, **kwargs)
        for x in args:
            self._check(x)
        for x in kwargs.values():
            self._check(x)
        return func(*args, **kwargs)
