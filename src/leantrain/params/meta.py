"""A module built on torch's ``meta`` device: memory of its own, filled later.

``with torch.device("meta"): model = GPT(config)`` builds a module whose tensors have a
shape and a dtype but no values, at no cost. A ``Runner`` made of it gives each meta
Parameter and buffer memory on the CPU through ``torch.empty``, which the operating
system backs only where it is written: nothing is resident until a value lands, so a
model of any size costs nothing here. The tensors are *unfilled* until a run fills them
(``sharding="parameters"`` with ``init_weights`` or ``init_from``, each rank its own
ranges, unit by unit: ``training/parallel/sharding/fill.py``; or a resumed checkpoint);
any other use of an unfilled tensor is refused with its name.

torch cannot move a meta Parameter's data to another device in place, so each meta
Parameter is replaced by a new one (the same ``requires_grad``), once per object, in
every module that holds it: a tie stays a tie (``lm_head.weight is tok_emb.weight``
after as before). A meta buffer is replaced the same way.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError


def is_meta(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "meta"


def give_memory(op: str, module: torch.nn.Module) -> dict[int, str]:
    """Give every meta Parameter and buffer of ``module`` CPU memory (untouched: nothing
    resident) and return ``{id(new tensor): its first name}``: what is still to be filled.
    A meta tensor that is a view of another is refused before anything changes."""
    found: dict[int, tuple[str, torch.Tensor]] = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        for table in (m._parameters, m._buffers):
            for k, t in table.items():
                if is_meta(t) and id(t) not in found:
                    name = f"{prefix}.{k}" if prefix else k
                    if t._is_view() or not t.is_contiguous():
                        raise ConfigError(f"{op}: {name!r} is a view on torch's meta device; a module built on meta "
                                          f"is given memory tensor by tensor: make it a tensor of its own")
                    found[id(t)] = (name, t)
    if not found:
        return {}
    new: dict[int, torch.Tensor] = {}
    for key, (_, t) in found.items():
        empty = torch.empty(t.shape, dtype=t.dtype)  # virtual memory: backed only where written
        new[key] = torch.nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) \
            else empty
    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for k, t in list(table.items()):
                if t is not None and id(t) in new:
                    table[k] = new[id(t)]
    return {id(new[key]): name for key, (name, _) in found.items()}


def refuse_unfilled(op: str, unfilled: dict) -> None:
    if unfilled:
        name = next(iter(unfilled.values()))
        raise ConfigError(f"{op}: {name!r} was built on torch's meta device and has no values yet ({len(unfilled)} "
                          f"tensor(s) unfilled); fill them in a run: sharding='parameters' with init_weights (a "
                          f"function, called as module.apply calls it) and/or init_from (a weights file or Hugging "
                          f"Face folder), or resume_from a checkpoint")


def unfilled_outside(runner) -> list[str]:
    """Why a checkpoint cannot fill a model built on meta: an unfilled tensor that is not
    one of its slots (a non-persistent buffer: no checkpoint holds it)."""
    slots = {id(v.storage.host) for v in runner.params}
    return [f"{name!r} was built on torch's meta device and is not in a checkpoint (a non-persistent buffer): "
            f"resume a model that computes it (build the module, or that buffer, off meta)"
            for key, name in runner.unfilled.items() if key not in slots]


def guard_released(module, released: dict) -> None:
    """A module a ``"parameters"`` run left released (its Parameters' memory given back,
    ``released``: id of each such Parameter -> its name) answers its own forward with a
    ``ConfigError`` naming the tensor, not torch's error about a storage of size 0. The
    hook on each module holding one goes at the first forward that finds its values back
    (a checkpoint loaded into it)."""
    for m in module.modules():
        mine = [(p, released[id(p)]) for p in m.parameters(recurse=False) if id(p) in released]
        if not mine:
            continue
        handle: list = []

        def check(mod, args, mine=mine, handle=handle):
            empty = [name for p, name in mine if p.untyped_storage().nbytes() == 0]
            if empty:
                raise ConfigError(
                    f"{empty[0]!r} holds no values: the sharding='parameters' run ended with the module released "
                    f"(gather_at_end=False, or a model built on meta), its result in its sharded checkpoint; "
                    f"put it back with lt.load_checkpoint(path, runner), or train with gather_at_end=True")
            handle.pop().remove()  # the values are back: the guard goes

        handle.append(m.register_forward_pre_hook(check))

