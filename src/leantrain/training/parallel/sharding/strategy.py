"""Sharding's run (ZeRO stages 1, 2 and 3): the ``ShardedStrategy`` a loop chooses.

At the start it cuts the plan (``plan.py``) and the history to this rank's ranges
(``state.py``) and installs them in its ``Sharded`` reduction (``reduction.py``);
``"parameters"`` also releases the parameters' memory (``gathering.py``) until the run
ends. Before each update it checks that the trainable slots are still those the plan was
cut for; every rank writes its pieces of a checkpoint folder (``checkpoint.py``); the
moving average is sharded as the state is (``ema.py``).
"""

from __future__ import annotations

import contextlib

from ....errors import ConfigError
from ...runner.runner import Runner
from .. import distributed
from ..data_parallel import DataParallelStrategy
from ..strategy import ParallelOptions
from .checkpoint import save_sharded
from .ema import ShardedEMA
from .fill import fill
from .resume import installed, take, wanted_ranges
from .gathering import ParameterShards
from .reduction import Sharded
from .state import check_plan, loop_start


def ends_whole(settings, runner: Runner) -> bool:
    """Whether a ``"parameters"`` run gathers the module whole when it ends: ``gather_at_end``
    (of its ``ParallelOptions``), or by default when the module was not built on meta (that
    one's result is its checkpoint)."""
    return settings.gather_at_end if settings.gather_at_end is not None else not runner.built_on_meta


def check_trainable_kept(op: str, runner: Runner) -> None:
    """A sharded run trains the slots trainable at its start: a ``requires_grad`` turned on
    or off since (a callback unfreezing a backbone) is refused before the next update or
    save, so no checkpoint marks a slot trainable without its optimizer state."""
    changed = runner.view.changed_requires_grad()
    if changed:
        i = changed[0]
        now = "on" if runner.view.originals[i].requires_grad else "off"
        raise ConfigError(
            f"{op}: {runner.params.label(i)}: requires_grad was turned {now} during a sharded run; sharding cut "
            f"the optimizer state of the slots trainable when the run started, so it cannot follow (nothing was "
            f"saved with the change: the last checkpoint stays valid). Start a new sharded run with the slot "
            f"{'trainable' if now == 'on' else 'frozen'} from the start (from these weights), or train unsharded")


class ShardedStrategy(DataParallelStrategy):
    """``sharding="optimizer"``, ``"gradients"`` or ``"parameters"`` over the ranks running
    (one or more); ``reduction`` is its ``Sharded`` seam, holding the plan once cut."""

    host_state = True  # a resume reads the state into host memory and moves this rank's ranges only
    saves_folder = True

    def __init__(self, settings: ParallelOptions, local: bool = False) -> None:
        reduction = Sharded(settings.exact_reduction, local)
        super().__init__(settings, reduction.local, reduction)
        self.name = reduction.name
        self.ranged: dict = {}  # a resume's ranges of the parameters (under "parameters"), until the start takes them

    def start(self, op: str, runner: Runner, opt, native: bool, whole=None):
        r, settings = self.reduction, self.settings
        plan, state = loop_start(op, settings, runner, opt, native, whole)
        if plan.mode == "parameters":
            if r.local:
                raise ConfigError(f"{op}: sharding='parameters' needs every rank to read the same batches (each "
                                  f"rank's own items would give the ranks different numbers of forwards, and "
                                  f"the gathers are collectives); give the loop the whole data, or shard "
                                  f"'gradients'")
            ranged = self.ranged
            if ranged:  # a resume read this rank's ranges of the parameters (resume.py)
                filling = lambda shards: take(shards, ranged, runner.params)  # noqa: E731
            elif runner.unfilled:  # a model built on meta: each rank fills its ranges (fill.py)
                filling = lambda shards: fill(op, shards, runner, settings.init_weights, settings.init_from)  # noqa: E731
            else:
                filling = None
            self.ends_whole = ends_whole(settings, runner)
            r.shards = ParameterShards(op, runner, plan, r.rank, filling,  # the parameters' memory released from here
                                       settings.shard_units)
            runner.unfilled, self.ranged = {}, {}
            r.guard_next = True
        r.plan = plan
        return state

    def resume_ranges(self, runner: Runner):
        return wanted_ranges(self.settings, runner)  # each rank reads its own ranges of a sharded folder

    def resumed(self, runner: Runner, ranged: dict) -> None:
        installed(runner, ranged)
        self.ranged = ranged

    def guard(self, op: str):
        """Until the run's first update is applied, a read of a released Parameter is
        refused (``gathering.py``): the model's calls are the same from then on."""
        r = self.reduction
        if r.guard_next and r.shards is not None:
            return r.shards.guarded(op)
        return contextlib.nullcontext()

    def user_code(self):
        """The user's code between updates sees every Parameter whole."""
        shards = self.reduction.shards
        return contextlib.nullcontext() if shards is None else shards.whole()

    def close(self, runner: Runner, failed: bool) -> None:
        r = self.reduction
        if r.shards is not None:
            r.shards.close(failed)
            r.shards = None
            if isinstance(runner.ema, ShardedEMA):
                runner.ema.shards = None  # closed: the module holds its weights again

    def ema(self, runner: Runner, decay: float, saved=None):
        r = self.reduction
        if saved is None:
            return ShardedEMA(runner.params, decay, r.plan, r.rank, shards=r.shards)
        return ShardedEMA.cut(runner.params, saved, r.plan, r.rank, r.shards)  # cut from host memory

    def check_shared(self, op: str, checkpoint_path) -> None:
        # every rank writes its shard into the folder: one per node would save, and never load
        distributed.check_shared_folder(op, checkpoint_path)

    def before_update(self, op: str, runner: Runner, batch: list) -> None:
        check_trainable_kept(op, runner)  # before the binding would follow a changed requires_grad
        check_plan(op, self.reduction.plan, runner.slot_map())
        super().before_update(op, runner, batch)

    def save(self, path, runner: Runner, state, progress: dict, loader_state, ema, identity=None, *,
             averaged=None) -> None:
        check_trainable_kept("save_checkpoint", runner)  # never a checkpoint marking a slot with no state
        # every rank writes its file, rank 0 the index (checkpoint.py)
        if callable(loader_state):
            loader_state = loader_state()
        r = self.reduction
        save_sharded(path, runner, r.plan, r.rank, state, progress=progress, loader_state=loader_state, ema=ema,
                     values=None if r.shards is None else r.shards.values, identity=identity)

    def finish(self, runner: Runner) -> None:
        r = self.reduction
        if r.shards is not None and not self.ends_whole:  # the result is the sharded checkpoint
            r.shards.end_released(runner)
            r.shards = None
            runner.keep_ema(None)
            return
        self.close(runner, failed=False)  # the module whole again (parameter sharding)
        if isinstance(runner.ema, ShardedEMA):
            runner.keep_ema(runner.ema.whole(runner.params))  # every rank: the whole average

    def failed(self, op: str, e: RuntimeError, where: str, last: str):
        if not self.reduction.ranks:
            raise e
        super().failed(op, e, where, last)
