"""The user's code a run calls between updates: the step callback and the callbacks' hooks.

``Listeners`` calls them after an update, at an epoch's end and after an evaluation, and
says whether one asked to stop. Two facts follow from who wrote them:

* code that may change the module (a step callback, a callback not declaring
  ``reads_only``) makes the runner confirm the module at the next update
  (``Runner.user_code_ran``);
* the user's own callbacks (the same on every rank: the program's list, before rank 0's
  are picked) run inside the strategy's ``user_code``, where parameter sharding gives
  them the parameters whole.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

from ..runner.runner import Runner
from ..parallel.strategy import Strategy
from .callbacks import Callback, EarlyStopping
from .events import StepCallback, StepEvent
from .loop_checks import wants_stop

_NOTHING = contextlib.nullcontext()


class Listeners:
    """The run's step callback and callbacks (``whole``: the run's, checked, alike on
    every rank but a progress bar; ``given``: the program's list). ``callbacks``: those
    this rank runs (rank 0: all; others: those that run on ``every_rank``)."""

    def __init__(self, op: str, runner: Runner, strategy: Strategy, callback: Optional[StepCallback],
                 whole: Sequence[Callback], given: Sequence[Callback], failed=None) -> None:
        self.op, self.runner, self.strategy, self.failed = op, runner, strategy, failed
        self.callback, self.callbacks = callback, [cb for cb in whole if strategy.main or cb.every_rank]
        self.may_change = callback is not None or not all(cb.reads_only for cb in self.callbacks)
        self.users = callback is not None or any(not type(cb).__module__.startswith("leantrain.") for cb in given)
        #: the hooks whose answer may stop the run, decided once for the job and shared by every rank (one
        #: process: none to share)
        self.decides = decisions(callback, given) if strategy.reduction.ranks else ()

    def _user_code(self):
        return self.strategy.user_code() if self.users else _NOTHING

    def _ran(self) -> None:
        if self.may_change:
            self.runner.user_code_ran()  # the user's code ran: confirm the module at the next step

    def step(self, event: StepEvent) -> bool:
        """After an update: the step callback, then each callback's ``on_step``. True: stop."""
        with self._user_code():
            stop = self.callback is not None and wants_stop(self.op, "the step callback", self.callback(event))
            for cb in self.callbacks:
                stop = wants_stop(self.op, f"{type(cb).__name__}.on_step", cb.on_step(event)) or stop
        self._ran()
        return stop

    def epoch_end(self, event: StepEvent) -> bool:
        """After a loader epoch's last update: each callback's ``on_epoch_end``. True: stop."""
        stop = False
        with self._user_code():
            for cb in self.callbacks:
                stop = wants_stop(self.op, f"{type(cb).__name__}.on_epoch_end", cb.on_epoch_end(event)) or stop
        self._ran()
        return stop

    def evaluated(self, step: int, results: dict, user_metrics: bool) -> bool:
        """After an evaluation: each callback's ``on_eval`` (``user_metrics``: the user's
        metric functions ran too). True: stop."""
        stop = False
        with self._user_code():
            for cb in self.callbacks:
                stop = wants_stop(self.op, f"{type(cb).__name__}.on_eval", cb.on_eval(step, results)) or stop
        if user_metrics:
            self.runner.user_code_ran()
        self._ran()
        return stop

    def decide(self, stop: bool, step: int, hooks: tuple) -> bool:
        """The job's answer after update ``step``, whose ``hooks`` ran (this rank's answer
        ``stop``): under torch.distributed a stop any rank's code asked for stops every rank
        at this update (one tiny collective of host memory, where one of ``hooks`` may stop
        the run at all), as Lightning reduces ``should_stop``. A peer lost meanwhile is
        reported by ``failed(error, where)`` (the session's: a ``CollectiveError``)."""
        if not any(h in self.decides for h in hooks):
            return stop
        try:
            return self.strategy.any_rank(stop)
        except Exception as e:
            if self.failed is None:
                raise
            self.failed(e, f"after update {step} (the job's decision to stop, {'/'.join(hooks)})")
            raise  # failed raises; never reached


def decisions(callback: Optional[StepCallback], given: Sequence[Callback]) -> tuple[str, ...]:
    """The hooks whose answer may stop a run (alike on every rank: the program's callbacks):
    the step callback's; a user's callback's overridden hooks; ``EarlyStopping``'s
    ``on_eval`` (leantrain's loggers, trackers and progress bar never stop a run)."""
    def may(hook: str) -> bool:
        return any((not type(cb).__module__.startswith("leantrain.") and getattr(type(cb), hook) is not
                    getattr(Callback, hook)) or (isinstance(cb, EarlyStopping) and hook == (
                        "on_step" if cb.monitor == EarlyStopping.TRAIN else "on_eval")) for cb in given)

    hooks = ("on_step",) if callback is not None or may("on_step") else ()
    return hooks + tuple(h for h in ("on_epoch_end", "on_eval") if may(h))
