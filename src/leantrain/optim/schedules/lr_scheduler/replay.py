"""What every torch-named schedule shares: the param groups it writes, replayed.

A torch scheduler is an object that rewrites its optimizer's ``param_groups`` in place:
at construction (its first step) and at each ``step()``, most classes from the group's
current rate (``group["lr"] * gamma``), so a rate is a product of roundings a closed form
does not reproduce bit for bit. leantrain's schedule of the same name is a *plan*: its
arguments and the optimizer's groups (each group's rate and, where the optimizer has one,
its momentum or first beta). ``rates(t)`` replays torch's arithmetic on a list of plain
groups: the construction, then ``t`` steps, in torch's order; a replay is kept and
continued (the loop asks index after index), and started over for an earlier index (a
resume): the same operations, so the same bits. A torch optimizer made with a tensor rate
(``lr=torch.tensor(0.05)``) is ported with it: its groups hold a float32 tensor, which
torch's arithmetic keeps and torch fills with each new rate, here too.

``Run`` is one replay's mutable side (torch's scheduler object: ``last_epoch``, the step
count, whether the first step is running); a plan's ``get_lr(run)`` is torch's
``get_lr``, ``closed_form(run)`` its ``_get_closed_form_lr`` (what ``SequentialLR``
calls at a milestone).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ....errors import ConfigError
from ....validate import is_number
from ..upstream import Schedule

ParamGroups = list[dict]

#: the most steps a resumed or ported scheduler is replayed through before its index 0
MAX_REPLAY = 10**7


def check_replay(op: str, steps: int, what: str) -> None:
    """A scheduler that stands ``steps`` steps in is replayed through them (torch's bits:
    its arithmetic from the construction on); past ``MAX_REPLAY`` that would take minutes
    to hours, so it is refused by name instead of hanging."""
    if steps > MAX_REPLAY:
        raise ConfigError(f"{op}: {what} {steps} steps in: leantrain replays torch's arithmetic from the "
                          f"construction to give its bits, and {steps} steps is past the {MAX_REPLAY:,} it replays; "
                          f"start the schedule at a smaller index (or write the rates as a closed form, "
                          f"optim.lambda_schedule)")


def describe(optimizer) -> tuple[tuple[float, ...], Optional[str], Optional[tuple[float, ...]]]:
    """What a schedule reads of what it is given for ``optimizer``: each group's rate, the
    kind of momentum the optimizer has (``"momentum"``, ``"betas"`` or ``None``) and each
    group's value of it. A leantrain ``Optimizer`` (its groups), or a rate (one group) or a
    list of rates (one per group) with no momentum."""
    from ...optimizer import Optimizer
    from ...opt_state import MOMENTUM_FIELD

    if isinstance(optimizer, Optimizer):
        name = MOMENTUM_FIELD.get(optimizer.kind)
        kind = None if name is None else ("betas" if name == "beta1" else "momentum")
        return optimizer.groups_rates(), kind, optimizer.groups_momenta()
    rates = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not rates or not all(is_number(r) and 0 <= r < math.inf for r in rates):
        raise ConfigError(f"a schedule needs the leantrain optimizer it schedules (optim.adamw(...)), or its rate, "
                          f"got {optimizer!r:.60}")
    return tuple(float(r) for r in rates), None, None


def set_rate(group: dict, value) -> None:
    """torch's write of a group's rate: a tensor rate is filled (the value rounded to its
    dtype, float32), a number replaced."""
    if isinstance(group["lr"], torch.Tensor):
        group["lr"] = torch.full((), float(value), dtype=group["lr"].dtype)
    else:
        group["lr"] = value


def per_group(op: str, name: str, value: Any, groups: int) -> list:
    """torch's ``_format_param``: a value per group (a list of that length, or one value for all)."""
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ConfigError(f"{op}: {name} must have one value per param group ({groups}), got {len(value)}")
        return list(value)
    return [value] * groups


class Run:
    """One replay of a plan on ``groups`` (torch's scheduler object, its mutable side)."""

    def __init__(self, plan: "LRScheduler", groups: ParamGroups, last_epoch: int = -1) -> None:
        self.plan, self.groups = plan, groups
        plan.attach(self)  # what the class's constructor writes into the groups first
        if last_epoch == -1:
            for g in groups:  # torch clones a tensor rate: the base stays as the rate was
                g.setdefault("initial_lr", g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"])
        self.base_lrs = [g["initial_lr"] for g in groups]
        plan.after_bases(self)
        self.last_epoch = last_epoch
        self.initial_step()

    def initial_step(self) -> None:
        self.step_count, self.initial = 0, True
        self.step()
        self.initial = False

    def step(self) -> None:
        self.plan.run_step(self)

    def update_lr(self, epoch: Optional[int]) -> None:
        """torch's ``_update_lr``: the next epoch by the class's recursion, or ``epoch``
        by its closed form where it has one."""
        if epoch is None:
            self.last_epoch += 1
            values = self.plan.get_lr(self)
        else:
            self.last_epoch = epoch
            values = self.plan.closed_form(self)
        for g, lr in zip(self.groups, values):
            set_rate(g, lr)

    def lrs(self) -> list:
        return [g["lr"] for g in self.groups]


class LRScheduler(Schedule):
    """A torch scheduler as leantrain's schedule (see the module docstring). Subclasses
    set their arguments, call ``__init__`` with the optimizer (or its rate), and define
    ``get_lr`` (and ``closed_form``, ``attach`` where torch's class has them)."""

    torch_name: str = ""  #: the torch class it follows (``torch.optim.lr_scheduler`` or ``swa_utils``)

    def __init__(self, optimizer, last_epoch: int = -1) -> None:
        self.op = f"lr_scheduler.{self.torch_name}"
        if not (isinstance(last_epoch, int) and not isinstance(last_epoch, bool) and last_epoch >= -1):
            raise ConfigError(f"{self.op}: last_epoch must be an integer >= -1, got {last_epoch!r}")
        check_replay(self.op, last_epoch + 1, f"last_epoch={last_epoch} stands")
        self.bases, self.momentum_kind, self.momenta = describe(optimizer)
        self.on_rate = not hasattr(optimizer, "groups_rates")  #: made from a rate, not a leantrain optimizer
        self.last_epoch = last_epoch
        self._memo: Optional[tuple[int, Any]] = None

    # ------------------------------------------------------------ the class's arithmetic
    def attach(self, run: Run) -> None:
        """What torch's constructor writes into the groups before the first step."""
        return None

    def after_bases(self, run: Run) -> None:
        """What torch's constructor sets once the base rates are read."""
        return None

    def get_lr(self, run: Run) -> list:
        raise NotImplementedError

    def run_step(self, run: Run) -> None:
        """torch's ``step()`` (a class with its own, as ``CosineAnnealingWarmRestarts``, overrides it)."""
        run.step_count += 1
        run.update_lr(None)

    def closed_form(self, run: Run) -> list:
        """torch's ``_get_closed_form_lr`` (its ``get_lr`` where the class has none)."""
        return self.get_lr(run)

    # ------------------------------------------------------------------- replaying
    @property
    def groups(self) -> int:
        return len(self.bases)

    def new_groups(self) -> ParamGroups:
        """The optimizer's groups as torch's scheduler finds them."""
        out = []
        for k, lr in enumerate(self.bases):
            g: dict = {"lr": lr if self.rate_dtype is None else torch.full((), lr, dtype=self.rate_dtype)}
            if self.momentum_kind == "momentum":
                g["momentum"] = self.momenta[k]
            elif self.momentum_kind == "betas":
                g["betas"] = (self.momenta[k], None)
            out.append(g)
        return out

    def start(self, groups: ParamGroups) -> Any:
        """A replay on ``groups`` (a composition starts its parts on shared groups)."""
        return Run(self, groups, self.last_epoch)

    def advance(self, replay: Any) -> None:
        replay.step()

    rate_dtype: Optional[torch.dtype] = None  #: a port of an optimizer with tensor rates: their dtype
    skip: int = 0  #: steps a ported scheduler had taken (``from_torch``): index 0 is the rate after them

    def offset(self) -> int:
        """Steps a plan starts after: a ported scheduler's steps, and (torch: a scheduler
        resumed at ``last_epoch = k`` is where a fresh one is after ``k + 1`` steps)."""
        return self.skip + (0 if self.last_epoch == -1 else self.last_epoch + 1)

    def replay_to(self, t: int) -> ParamGroups:
        """The groups after ``t`` steps (index ``t``), continuing the kept replay."""
        want = t + self.offset()
        memo = self._memo
        if memo is None or memo[0] > want:
            groups = self.new_groups()
            replay = self.start(groups) if self.last_epoch == -1 else self._fresh_copy().start(groups)
            memo = self._memo = [0, replay, groups]
        while memo[0] < want:
            self.advance(memo[1])
            memo[0] += 1
        return memo[2]

    def _fresh_copy(self) -> "LRScheduler":
        """This plan as made fresh (``last_epoch=-1``): a resumed scheduler replays from its
        construction (the offset says where it stands)."""
        import copy

        fresh = copy.copy(self)
        fresh.last_epoch, fresh._memo = -1, None
        return fresh

    def rates_at(self, t: int) -> tuple[tuple[float, ...], Optional[tuple[float, ...]]]:
        """Each group's rate at index ``t`` and, where the schedule cycles it, each group's
        momentum or first beta (``None``: not cycled)."""
        groups = self.replay_to(t)
        lrs = tuple(float(g["lr"]) for g in groups)
        if not self.cycles_momentum():
            return lrs, None
        key = self.momentum_kind
        return lrs, tuple(float(g["momentum"] if key == "momentum" else g["betas"][0]) for g in groups)

    def cycles_momentum(self) -> bool:
        return False

    def lr_at(self, t: int) -> float:
        """The first group's rate at index ``t``."""
        return self.rates_at(t)[0][0]

    def max_rate(self) -> Optional[float]:
        return None  # a recursion's largest rate is known only by running it

    def __repr__(self) -> str:
        return f"{self.torch_name}(groups={self.groups})"


def current(run: Run) -> list:
    """torch's ``_param_groups_val_list(optimizer, "lr")``: the groups' rates as they are."""
    return [g["lr"] for g in run.groups]
