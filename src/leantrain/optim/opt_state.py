"""An optimizer's history: ``OptState``, the per-slot records and the rates of the next step.

``lr`` is the base rate of the next update (a schedule rewrites it); ``lrs``, when set,
is the rate of each param group (torch-style groups keep their own rates, exactly, and a
schedule that follows torch's may set each group's); ``momenta``, when set, each group's
momentum (SGD, RMSprop, Muon) or first beta (Adam's family), which torch's ``OneCycleLR``
and ``CyclicLR`` cycle. A slot's rate is its group's times its ``lr_scale``
(``per_slot``): ``rate``; its hyperparameters with its group's momentum: ``cycled``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from .hyper import Hyper, check_rate

# The field torch's momentum-cycling schedules set, per kind: "momentum" or torch's first beta.
MOMENTUM_FIELD = {"sgd": "momentum", "rmsprop": "momentum", "muon": "momentum", "adam": "beta1", "adamw": "beta1",
                  "nadam": "beta1", "radam": "beta1", "adamax": "beta1"}


@dataclass(frozen=True)
class OptState:
    """Per-slot optimizer records plus the bound configuration and path.

    ``slots[i]`` is a typed record (``AdamState``...) at a representative, the
    representative's record at an alias on the generic path, and ``None`` at frozen
    slots (and at aliases on the native path). ``lr`` is the rate of the next step
    (schedules rewrite it); ``steps`` counts completed updates; ``lrs``/``momenta``: see
    the module docstring; ``bases``: the param groups' own rates, as the optimizer gave
    them (empty: one group).
    """

    hyper: Hyper
    lr: float
    path: str
    slots: tuple
    steps: int = 0
    overrides: tuple = ()  # the per-slot hyperparameters asked for: ((slot, ((key, value), ...)), ...)
    lrs: tuple = ()
    momenta: tuple = ()
    bases: tuple = ()

    def with_lr(self, lr: float) -> "OptState":
        """The same state with the base rate set to ``lr``: every slot's rate is ``lr``
        times its ``lr_scale``, every param group's ``lr`` times the ratio of its own rate
        to the optimizer's (a schedule of one rate over several groups, as ``lr_scale``)."""
        if lr == self.lr:
            return self
        lr = check_rate("OptState.with_lr", "lr", lr)
        lrs = () if not self.bases else tuple(lr if b == self.hyper.lr else lr * (b / self.hyper.lr)
                                              for b in self.bases)
        return replace(self, lr=lr, lrs=lrs, momenta=())

    def with_rates(self, lrs, momenta: Optional[tuple] = None) -> "OptState":
        """The same state with each param group's rate (and, when given, its momentum or
        first beta) set as a schedule that follows torch's computed them."""
        lrs, momenta = tuple(lrs), tuple(momenta or ())
        if len(lrs) == 1 and not momenta:
            return self.with_lr(lrs[0])
        if lrs == self.lrs and momenta == self.momenta:
            return self
        for g, r in enumerate(lrs):
            check_rate("OptState.with_rates", f"lr of group {g}", r)
        return replace(self, lr=lrs[0], lrs=lrs, momenta=momenta)

    def cycled(self, hyper: Hyper, group: int) -> Hyper:
        """``hyper`` with its group's momentum (or first beta) where a schedule cycles it."""
        if not self.momenta:
            return hyper
        value = self.momenta[group]
        name = MOMENTUM_FIELD[hyper.kind]
        if getattr(hyper, name) == value:
            return hyper
        cache = _CYCLED.get(id(hyper))
        if cache is None or cache[0] is not hyper:
            cache = _CYCLED[id(hyper)] = (hyper, {})
            if len(_CYCLED) > 256:
                _CYCLED.clear()
                _CYCLED[id(hyper)] = cache
        found = cache[1].get(value)
        if found is None:
            found = cache[1][value] = replace(hyper, **{name: value})
            if len(cache[1]) > 4096:
                cache[1].clear()
        return found

    def records(self) -> dict[int, object]:
        """Slot index -> record for the slots that own their history."""
        out, seen = {}, set()
        for i, r in enumerate(self.slots):
            if r is not None and id(r) not in seen:
                seen.add(id(r))
                out[i] = r
        return out


_CYCLED: dict = {}  # id(hyper) -> (hyper, {momentum: hyper with it}): a cycled momentum's record made once
