"""A sharded run resuming a sharded folder in bounded memory (#55, item 2).

Each rank reads only the element ranges it will own (the plan of this run: any old and
new world size, any mode), straight from the files into memory of its own (``pread``,
``io/sharded.py``): its ranges of every optimizer state tensor and of the moving average,
and under ``"parameters"`` its ranges of the trained parameters too, which are not
installed into the module (its memory is released) but handed to the run's start, where
they become the rank's values (``ParameterShards``). What every rank holds whole anyway
(the parameters under ``"optimizer"`` and ``"gradients"``, frozen slots, buffers,
generator and loader states) is read whole. A rank verifies every piece it reads from;
together the ranks read every piece. A resume whose trainable set differs from the file's
(a slot frozen or unfrozen across it) reads the folder whole, as before.
"""

from __future__ import annotations

from typing import Callable, Optional

from .. import distributed
from .plan import plan_for
from .state import own_range


def wanted_ranges(settings, runner, plan=None) -> Callable:
    """``read_folder``'s ``wanted`` for this rank of a run sharded as ``settings`` (its
    ``ParallelOptions``) say over ``runner`` (``plan``: the run's own cut of the parameters,
    ``engine="fsdp2"``'s)."""
    rank, world = distributed.rank_world()
    params = runner.params
    plan = plan_for(settings.sharding, params, world, settings.shard_by) if plan is None else plan
    storage_of = {id(s): k for k, s in enumerate(params.storages())}
    by_storage: dict = {}
    for r in plan.owned(rank):
        by_storage.setdefault(storage_of[id(params[r.slot].storage)], []).append((r.start, r.stop))
    owned = {r.slot: [(r.start, r.stop)] for r in plan.owned(rank)}
    trainable = list(params.requires_grad_array())
    cut_parameters = plan.mode == "parameters"

    def ranges_of(name: str) -> Optional[list]:
        kind, _, rest = name.partition(".")
        if kind == "state":
            return owned.get(int(rest.partition(".")[0]), [])
        if kind == "ema" or kind == "storage" and cut_parameters:
            return by_storage.get(int(rest), [])
        return None

    def wanted(checked) -> Optional[Callable]:
        if list(checked.schema.requires_grad) != trainable:
            return None  # the trainable set changes at the resume: the plan is cut after it, from the whole
        return ranges_of

    return wanted


def installed(runner, ranged: dict) -> None:
    """After a resume's load: the slots it installed are filled; the parameters it handed
    back in ranges (``Checkpoint.ranged``) are, for the module, without values until the
    run's start takes its ranges."""
    storages = runner.params.storages()
    names: dict = {}
    for v in runner.params:
        names.setdefault(id(v.storage), v.name)  # a storage's first slot names it
    written = {id(s.host) for k, s in enumerate(storages) if k not in ranged}
    unfilled = {key: name for key, name in runner.unfilled.items() if key not in written}
    for k in ranged:
        unfilled.setdefault(id(storages[k].host), names[id(storages[k])])
    runner.unfilled = unfilled


def take(shards, ranged: dict, params) -> None:
    """This rank's values of the parameters from a resume's ranges (``ParameterShards``'s fill)."""
    storage_of = {id(s): k for k, s in enumerate(params.storages())}
    for r, v in list(shards.values.items()):
        shards.values[r] = own_range(ranged[storage_of[id(params[r.slot].storage)]], r, v.device)
