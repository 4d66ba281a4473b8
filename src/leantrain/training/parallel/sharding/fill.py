"""Filling a model built on torch's meta device, each rank its own ranges (``"parameters"``).

The module's unfilled tensors (``params/meta.py``) have memory the operating system has
not backed yet. Under parameter sharding each rank keeps only its ranges of a trained
Parameter, so a rank never holds the whole model:

- ``init_weights`` is called on every module in ``module.apply``'s order (children
  first), under ``no_grad``, so its random draws are those of ``model.apply(fn)`` on a
  built model, rank by rank alike. A trained Parameter the call touches (any torch call
  taking it, ``p.data``'s alias included) is gathered whole for the call's length (a
  collective: every rank runs the same calls in the same order), so a call sees what
  earlier calls wrote (a tie written twice, a rescale of a whole tensor) at any world
  size; when the call returns, this rank's ranges are kept and the memory released: the
  most held at once is what one call touches (one module's Parameters, as ``nn.init``
  functions write them). Elements no call has written yet read as NaN (a Parameter read
  before it is written is refused below). ``"reset_parameters"``: each module's own
  ``reset_parameters()``, torch's.
- ``init_from`` (a safetensors weights file, or a Hugging Face folder, by the module's
  ``state_dict`` names; a tie saved once is found under either name) then replaces what
  it holds: each rank reads its ranges only, out of the file's mapping.

Frozen Parameters and buffers are not cut: they are filled whole on every rank. Every
unfilled tensor must be given values by one of the two, and no kept range may hold NaN:
otherwise a ``ConfigError`` names the first, the same on every rank. With peers, the
ranks first agree that their generators are alike (``ReplicaError`` if not): each rank
draws every value and keeps its own.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Optional, Union

import torch
from torch.overrides import TorchFunctionMode

from ....errors import ConfigError, ReplicaError
from ....io.weights import read_weights
from .. import distributed
from .guard import METADATA


def _calls(module: torch.nn.Module):
    """The modules ``module.apply(fn)`` calls ``fn`` on, in its order."""
    for child in module.children():
        yield from _calls(child)
    yield module


def _init_function(init_weights: Union[str, Callable]) -> Callable:
    if init_weights == "reset_parameters":
        def reset(m: torch.nn.Module) -> None:
            if callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()
        return reset
    return init_weights


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # the storage itself: an alias (p.data) has the same


class _Touch(TorchFunctionMode):
    """While ``init_weights`` runs: a released trained Parameter taken by a torch call
    (one that reads more than its description, ``guard.METADATA``) is gathered whole first;
    a whole unfilled tensor taken by one is marked given."""

    def __init__(self, filling: "Filling") -> None:
        super().__init__()
        self.filling = filling

    def _see(self, x) -> None:
        if isinstance(x, torch.Tensor):
            if x.device.type != "meta":
                self.filling.touched(_key(x))
        elif isinstance(x, (list, tuple)):
            for y in x:
                self._see(y)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) not in METADATA:
            for x in args:
                self._see(x)
            for x in kwargs.values():
                self._see(x)
        return func(*args, **kwargs)


class Filling:
    """One fill of a ``ParameterShards``' unfilled slots (see the module's text)."""

    def __init__(self, op: str, shards, runner) -> None:
        self.op, self.shards, self.runner = op, shards, runner
        unfilled = runner.unfilled
        params = runner.params
        self.sharded = {_key(shards.full[c]): c for c in shards.sharded if id(params[c].storage.host) in unfilled}
        self.whole = {_key(t): unfilled[id(t)] for t in _tensors(runner.module)
                      if id(t) in unfilled and _key(t) not in self.sharded}
        self.given: set = set()  # keys of tensors given values
        self.live: set = set()  # sharded slots holding memory during the current call
        self.owned = {}
        for r in shards.values:
            self.owned.setdefault(r.slot, []).append(r)

    def touched(self, key: int) -> None:
        c = self.sharded.get(key)
        if c is None:
            if key in self.whole:
                self.given.add(key)
            return
        self.given.add(key)
        if c not in self.live:
            self.shards.gather([c])  # every rank touches the same Parameters in the same order: a collective
            self.live.add(c)

    def settle(self) -> None:
        """A call returned: this rank's ranges of what it touched kept, the memory released."""
        s = self.shards
        with torch.no_grad():
            for c in self.live:
                view = s._storage_view(c)
                for r in self.owned.get(c, ()):
                    s.values[r].copy_(view[r.start: r.stop])
        s.release(sorted(self.live))
        self.live.clear()

    def run(self, init_weights, init_from) -> None:
        for c in self.sharded.values():
            for r in self.owned.get(c, ()):
                self.shards.values[r].fill_(math.nan)  # no value yet: a read before a write shows
        if init_weights is not None:
            agree_generators(self.op)
            fn = _init_function(init_weights)
            with torch.no_grad():
                for m in _calls(self.runner.module):
                    try:
                        with _Touch(self):
                            fn(m)
                    finally:
                        self.settle()
        if init_from is not None:
            self.read(init_from)
        self.check()

    def read(self, path) -> None:
        """``init_from``'s tensors by name: every name checked first, then this rank's
        ranges (and the whole tensors not cut) copied in."""
        op, s, params = f"{self.op}: init_from", self.shards, self.runner.params
        weights = read_weights(op, path)
        index = {id(s.full[c]): c for c in s.sharded}
        found, problems = [], []
        for i, v in enumerate(params):
            t = weights.get(v.name)
            if t is None:
                continue
            if tuple(t.shape) != tuple(v.shape) or t.dtype != v.dtype:
                problems.append(f"{params.label(i)}: expected {tuple(v.shape)} {v.dtype}, the file holds "
                                f"{tuple(t.shape)} {t.dtype}")
            found.append((i, t))
        if problems:
            raise ConfigError(f"{op}: {path}: {len(problems)} tensor(s) do not fit, nothing was read:\n  - "
                              + "\n  - ".join(problems[:8]))
        if not found:  # a prefix off ("model."), another model's file: nothing read would be said nowhere
            names = sorted(weights)
            raise ConfigError(f"{op}: {path}: none of the file's {len(names)} names is one of the model's (the "
                              f"file's first: {names[0] if names else None!r}; the model's first: "
                              f"{params[0].name if len(params) else None!r}); rename the file's tensors to the "
                              f"model's names (module.named_parameters()), nothing was read")
        holding_nan = [params[i].name for i, t in found if t.is_floating_point() and bool(torch.isnan(t).any())]
        if holding_nan:  # said here, not later as if init_weights had read an unwritten element
            raise ConfigError(f"{op}: {path}: {holding_nan[0]!r} holds NaN in the file ({len(holding_nan)} such "
                              f"tensor(s)), nothing was read")
        with torch.no_grad():
            for i, t in found:
                host = params[i].storage.host
                c = index.get(id(host))
                if c is not None:  # a trained Parameter, cut: this rank's ranges
                    flat = t.reshape(-1)
                    for r in self.owned.get(c, ()):
                        s.values[r].copy_(flat[r.start: r.stop])  # only this rank's pages of the file are read
                else:
                    params[i].storage.write_host(t)
                self.given.add(_key(host))

    def check(self) -> None:
        """Every unfilled tensor given values, and no NaN kept: agreed over the ranks."""
        missing = [self.shards.names[c] for k, c in self.sharded.items() if k not in self.given]
        missing += [name for k, name in self.whole.items() if k not in self.given]
        nan = sorted({self.shards.names[r.slot] for r, v in self.shards.values.items()
                      if r.slot in self.sharded.values() and bool(torch.isnan(v).any())})  # intentional reads: once, at the start
        verdicts = distributed.everyone((sorted(missing), nan))  # every rank raises alike
        missing, nan = verdicts[0][0], sorted({n for v in verdicts for n in v[1]})
        if missing:
            raise ConfigError(f"{self.op}: {missing[0]!r} was built on torch's meta device and neither init_weights "
                              f"nor init_from gave it values ({len(missing)} such tensor(s)); initialise it in "
                              f"init_weights (buffers too: a mask computed in __init__ is not computed on meta), or "
                              f"put it in init_from's file")
        if nan:
            raise ConfigError(f"{self.op}: {nan[0]!r} holds NaN after init_weights: the function read elements of "
                              f"it before any call wrote them (a model built on meta has no values until "
                              f"init_weights writes them: write before reading)")


def _tensors(module: torch.nn.Module) -> list:
    out, seen = [], set()
    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for t in table.values():
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
    return out


def agree_generators(op: str) -> None:
    """With peers: every rank's CPU generator must be in the same state (each rank draws
    every value of ``init_weights`` and keeps its own ranges)."""
    digest = hashlib.sha256(torch.random.get_rng_state().numpy().tobytes()).hexdigest()[:16]
    states = distributed.everyone(digest)
    if any(d != states[0] for d in states):
        bad = [r for r, d in enumerate(states) if d != states[0]]
        raise ReplicaError(f"{op}: init_weights draws on every rank alike, but the generators of ranks {bad} are "
                           f"not in rank 0's state: seed every rank the same (torch.manual_seed, or the loop's seed)")


def fill(op: str, shards, runner, init_weights, init_from: Optional[object]) -> None:
    """Fill ``runner``'s unfilled tensors into ``shards`` (see the module's text)."""
    Filling(op, shards, runner).run(init_weights, init_from)
