"""torch's compositions: ``SequentialLR`` (one scheduler after another; at a milestone the
next starts from its own index 0) and ``ChainedScheduler`` (every scheduler steps at
every index, each from the rate the one before it left). As in torch the parts are built
on the same optimizer, one after another, so a part that does not start at factor 1 (a
``LinearLR`` warm-up) carries its factor into the next: the replay starts the parts in
order on shared groups, then does what torch's composite does at construction and at
each step. torch refuses ``ReduceLROnPlateau`` in either (it needs the metric at each
step); so does leantrain.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Optional

from ....errors import ConfigError
from ....validate import is_int
from ..plateau import Plateau
from .replay import LRScheduler, ParamGroups, set_rate


def _parts(op: str, schedulers) -> tuple:
    if isinstance(schedulers, LRScheduler) or not isinstance(schedulers, (list, tuple)) or not schedulers:
        raise ConfigError(f"{op}: schedulers must be a non-empty list of leantrain.optim.lr_scheduler schedulers")
    for k, s in enumerate(schedulers):
        if isinstance(s, Plateau):
            raise ConfigError(f"{op}: schedulers[{k}] is a plateau scheduler, which needs the evaluated metric at "
                              f"each step; torch's {op.split('.')[-1]} refuses it too. Give it as the run's own "
                              f"scheduler")
        if not isinstance(s, LRScheduler):
            raise ConfigError(f"{op}: schedulers[{k}] is a {type(s).__name__}, not a torch-named scheduler of "
                              f"leantrain.optim.lr_scheduler (build each part with the optimizer: "
                              f"LinearLR(opt, ...))")
        if s.last_epoch != -1:
            raise ConfigError(f"{op}: schedulers[{k}] was made with last_epoch={s.last_epoch}; in a composition "
                              f"give the composition's last_epoch instead")
        first = schedulers[0]
        if s.groups != first.groups or s.momentum_kind != first.momentum_kind:
            raise ConfigError(f"{op}: schedulers[{k}] was made for {s.groups} param group(s), schedulers[0] for "
                              f"{first.groups}: build every part with the same optimizer")
    return tuple(schedulers)


class _Composite(LRScheduler):
    """What both compositions share: the parts' optimizer, started in order on shared groups."""

    def _adopt(self, parts: tuple) -> None:
        first = parts[0]
        self.schedulers = parts
        self.bases, self.momentum_kind, self.momenta = first.bases, first.momentum_kind, first.momenta

    def cycles_momentum(self) -> bool:
        return any(s.cycles_momentum() for s in self.schedulers)

    def max_rate(self) -> Optional[float]:
        return None


class CompositeRun:
    """One replay of a composition: its parts' replays (torch's ``_schedulers``)."""

    def __init__(self, plan: _Composite, groups: ParamGroups) -> None:
        self.plan, self.groups = plan, groups
        self.runs = [s.start(groups) for s in plan.schedulers]
        self.last_epoch = plan.last_epoch
        plan.construct(self)

    def step(self) -> None:
        self.plan.advance_parts(self)

    def initial_step(self) -> None:
        self.step()

    def update_lr(self, epoch: Optional[int]) -> None:
        raise ConfigError(f"{self.plan.op}: a composition inside SequentialLR cannot start over at a milestone "
                          f"(torch's cannot either); put its parts in the outer SequentialLR")


def _undo(run) -> None:
    """torch's ``recursive_undo``: every part's epoch one back (its construction's step)."""
    if isinstance(run, CompositeRun):
        for r in run.runs:
            _undo(r)
    else:
        run.last_epoch -= 1


class SequentialLR(_Composite):
    """``schedulers[k]`` from ``milestones[k-1]`` on, restarted there (torch's ``_update_lr(0)``)."""

    torch_name = "SequentialLR"

    def __init__(self, optimizer, schedulers, milestones, last_epoch: int = -1) -> None:
        super().__init__(optimizer, last_epoch)
        parts = _parts(self.op, schedulers)
        if len(parts[0].bases) != len(self.bases):
            raise ConfigError(f"{self.op}: the schedulers were made for {len(parts[0].bases)} param group(s), the "
                              f"optimizer has {len(self.bases)}")
        ms = list(milestones) if isinstance(milestones, (list, tuple)) else None
        if ms is None or len(ms) != len(parts) - 1 or not all(is_int(m) and m >= 0 for m in ms):
            raise ConfigError(f"{self.op}: milestones must be {len(parts) - 1} integers >= 0 (one fewer than the "
                              f"schedulers), got {milestones!r}")
        self._adopt(parts)
        self.milestones = tuple(ms)

    def start(self, groups: ParamGroups) -> CompositeRun:
        return CompositeRun(self, groups)

    def construct(self, run: CompositeRun) -> None:
        """torch's constructor: the rates back to each group's initial rate, every part's
        construction step undone, then the first part's initial step."""
        run.last_epoch += 1
        for g in run.groups:
            set_rate(g, g["initial_lr"])
        for r in run.runs:
            _undo(r)
        run.runs[bisect_right(self.milestones, 0)].initial_step()

    def advance_parts(self, run: CompositeRun) -> None:
        """torch's ``step()``: the part of this index steps, or starts over at its milestone."""
        run.last_epoch += 1
        k = bisect_right(self.milestones, run.last_epoch)
        if k > 0 and self.milestones[k - 1] == run.last_epoch:
            run.runs[k].update_lr(0)
        else:
            run.runs[k].step()

    def __repr__(self) -> str:
        return f"SequentialLR({list(self.schedulers)!r}, milestones={list(self.milestones)})"


class ChainedScheduler(_Composite):
    """Every scheduler steps at every index, in order (torch's argument order:
    ``ChainedScheduler(schedulers, optimizer=None)``)."""

    torch_name, constructor = "ChainedScheduler", "chained"

    def __init__(self, schedulers, optimizer=None) -> None:
        parts = _parts("lr_scheduler.ChainedScheduler", schedulers)
        super().__init__(list(parts[0].bases) if optimizer is None else optimizer)
        if len(parts[0].bases) != len(self.bases):
            raise ConfigError(f"{self.op}: the schedulers were made for {len(parts[0].bases)} param group(s), the "
                              f"optimizer has {len(self.bases)}")
        self._adopt(parts)

    def start(self, groups: ParamGroups) -> CompositeRun:
        return CompositeRun(self, groups)

    def construct(self, run: CompositeRun) -> None:
        """Nothing more: torch's constructor reads the rate the parts left."""
        return None

    def advance_parts(self, run: CompositeRun) -> None:
        """torch's ``step()``: every part steps, in order."""
        for r in run.runs:
            r.step()

    def __repr__(self) -> str:
        return f"ChainedScheduler({list(self.schedulers)!r})"
