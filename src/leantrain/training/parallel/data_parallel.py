"""Data parallel (``torch.distributed``): the ``DataParallel`` reduction and its gradients,
and the ``DataParallelStrategy`` that runs a loop with it.

Each rank differentiates its share of the items (item ``j`` on rank ``j mod world``,
or with rank-local data the items it read, ``rank_data.py``).
The default all-reduces the ranks' sums bucket by bucket while the last backward runs
(``overlap.py``); ``exact_reduction`` sends each item's gradient in ranges to their
owners, who fold them in item order, as one process does (``exact_fold.py``). With a model that draws random numbers, every item
starts from the generator state it has in one process (``item_states``), so an item
draws the same dropout mask whichever rank computes it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import distributed, overlap, rank_data
from .exact_fold import owner_fold
from ..runner.runner import Runner
from ..update.mean import item_gradients, sum_hooked
from ..update.mean import Mean
from ..update.reduction import Reduction
from .strategy import ParallelOptions, Strategy
from ...errors import CollectiveError, DataError
from ...samples import LossSum, add_losses


class DataParallel(Reduction):
    """Every rank computes its share of each update's items; the mean is all-reduced
    bucket by bucket under the last backward (the default) or, with ``exact``, every
    item's gradient is folded in item order by the owners of its ranges (the one-process bits).
    ``local``: each rank's batches hold its own items (``rank_data.py``)."""

    ranks = True
    holds_gradients = False  # between updates a rank holds its share only (the sharding figures)
    direct = False  # every item through the shared path, also one
    probes = True  # every rank runs every item's buffer pass: every rank learns alike

    def __init__(self, exact: bool = False, local: bool = False) -> None:
        self.exact, self.local = exact, local
        self.name = "data parallel" + (" (exact reduction)" if exact else "") + (", rank-local data" if local else "")

    def draw_states(self, runner: Runner) -> Optional[list]:
        # where each item's random draws start in one process (dropout); rank-local data draws its own
        return [] if runner.mode == "train" and runner.draws is not False and not self.local else None

    def count(self, runner: Runner, n: int) -> int:
        """The update's items over all ranks."""
        return rank_data.global_count(runner, n) if self.local else n

    def shares(self, batch: list, states: Optional[list]) -> tuple[list, Optional[list]]:
        """This rank's items of the update and the generator states they start from."""
        rank, world = distributed.rank_world()
        mine = batch if self.local else distributed.my_items(batch, rank, world)
        return mine, None if states is None else distributed.my_items(states[:-1], rank, world)

    def mean(self, runner: Runner, leaves, scratch, batch, o, want_loss: bool, states: Optional[list]) -> Mean:
        n = self.count(runner, len(batch))
        mine, own = self.shares(batch, states)
        if self.exact:
            return exact_gradients(runner, leaves, scratch, mine, n, *distributed.rank_world(), own)
        loss, grads = overlapped_sums(runner, leaves, scratch, mine, o.accumulation, want_loss, own)
        if loss is None:
            loss = torch.zeros((), device=runner.device)  # not asked for: never read
        return Mean.of_sums(loss, grads, n, o.scaler is None)

    def after(self, runner: Runner, advanced: bool) -> None:
        if advanced and self.local:
            rank_data.broadcast_buffers(runner)  # each rank advanced them on its own items: rank 0's, as DDP

    def redo(self, op: str) -> None:
        if self.ranks:  # one rank cannot redo a step the others have done
            raise DataError(f"{op}: the model wrote a buffer in this step although its first data-parallel step "
                            f"wrote none (a buffer written only for some inputs); under torch.distributed the "
                            f"ranks cannot redo one step apart")


class DataParallelStrategy(Strategy):
    """A loop under ``torch.distributed`` without sharding: the ranks agree on the run
    and on its first batch, start from rank 0's parameters, and only rank 0 logs and
    writes (``DataParallel`` makes each update's mean)."""

    watches_updates = True  # the ranks compare their first batch (once per loop)

    def __init__(self, settings: ParallelOptions, local: bool = False, reduction: Optional[DataParallel] = None) -> None:
        super().__init__(reduction if reduction is not None else DataParallel(settings.exact_reduction, local),
                         settings)
        self.local = local
        self.agreed = False  # whether the ranks compared their first batch (once per loop)
        self.name = self.reduction.name
        self.main = distributed.is_main()  # only rank 0 logs and writes

    def agree_on_start(self, op: str, what: dict) -> None:
        distributed.agree(op, what)  # every rank, or none

    def start_replicas(self, op: str, runner: Runner) -> None:
        try:
            distributed.start_replicas(runner, self.settings.replica_check)
        except distributed.ReplicaError:  # the replicas differ: that message, as it is
            raise
        except RuntimeError as e:
            self.failed(op, e, "start", "none saved yet")

    def before_update(self, op: str, runner: Runner, batch: list) -> None:
        if not self.local and not self.agreed:
            self.agreed = True
            rank_data.agree_on_batch(op, batch)  # the ranks read the same data (once per loop)

    def mean_loss(self, runner: Runner, samples) -> Optional[float]:
        if self.local:
            return rank_data.global_mean_loss(runner, samples)  # every rank's own items
        return runner.mean_loss(samples)

    def any_rank(self, flag: bool) -> bool:
        return distributed.any_rank(flag)

    def from_main(self, value):
        return distributed.from_main(value)

    def total(self, count):
        if not self.local or count is None:  # every rank read every item: its count is the job's
            return count
        return sum(distributed.everyone(count))  # rank-local data: each rank counted its own items

    def failed(self, op: str, e: RuntimeError, where: str, last: str):
        rank, world = distributed.rank_world()
        if not (isinstance(e, CollectiveError) or distributed.from_a_collective(e)):  # the user's own: as it is
            e.add_note(f"{op}: raised on rank {rank} of {world}, {where}; last good checkpoint: {last}")
            raise e
        raise CollectiveError(
            f"{op}: rank {rank} of {world}, {where}: a collective operation failed "
            f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); last good checkpoint: {last}"
        ) from e


def exact_gradients(runner: Runner, leaves, scratch, mine: list, n: int, rank: int, world: int,
                    own: Optional[list] = None) -> Mean:
    """Each rank differentiates its items (``mine``; item ``j`` of the ``n`` is on rank
    ``j mod world``) one by one, each sent in ranges to their owners as it is made; the
    owners fold every item in item order (``exact_fold.owner_fold``: ``accumulate.fold``'s
    additions), then ``* (1/n)``: the one-process mean gradient, bit for bit, on any number
    of ranks, holding a few gradient packs per rank whatever ``n``. ``own``: the generator
    states each of ``mine`` starts from (a model that draws)."""
    pairs = item_gradients(runner, mine, leaves, scratch, own)  # lazily: one item at a time
    losses, grads, first = owner_fold(pairs, n, rank, world, leaves)
    return Mean.of_sums(folded_loss(losses, first), grads, n)


def folded_loss(losses: list, first):
    """The item losses (float64, gathered) summed left to right in the first loss's dtype
    (``first``: this rank's first item's loss; ``None``: it had none)."""
    dtype = torch.float64 if first is None else (first.total if isinstance(first, LossSum) else first).dtype
    losses = [LossSum(x.total.to(dtype), x.count) if isinstance(x, LossSum) else x.to(dtype) for x in losses]
    loss = losses[0]
    for more in losses[1:]:
        loss = add_losses(loss, more)  # left to right, as fold
    return loss


def overlapped_sums(runner: Runner, leaves, scratch, mine: list, accumulation: str, want_loss: bool,
                     own: Optional[list] = None):
    """This rank's gradient sum over ``mine``, all-reduced over the ranks bucket by bucket
    while the last backward runs (see ``overlap.py``): the same fold as ``sum_items``, so
    the same bits as summing first and all-reducing after. ``(None, grads)`` unless
    ``want_loss`` or the loss is a ``LossSum`` (whose summed count divides the gradients:
    it is reduced every step, with its total)."""
    plan, reuse = overlap.step_buckets(runner, leaves)
    if not mine:  # more ranks than items: this rank sends zeros in the same buckets
        reducer = overlap.Reducer(plan, None, reuse)
        reducer.send(None)
        return _reduced(runner, reducer, None, None, want_loss)
    reducer, loss, grads = sum_hooked(runner, mine, leaves, scratch, own,
                                      lambda partial: overlap.Reducer(plan, partial, reuse),
                                      vectorized=accumulation == "vectorized")
    reducer.send(grads)
    return _reduced(runner, reducer, grads, loss, want_loss)


def _reduced(runner: Runner, reducer, grads, loss, want_loss: bool):
    """Wait for the gradients and reduce the loss: a ``LossSum``'s total and count as one
    float64 pair (a rank without items sends zeros), a scalar loss only if asked for."""
    if sums_losses(runner, loss):
        pair = torch.zeros(2, dtype=torch.float64, device=runner.device) if loss is None else torch.stack(
            [loss.total.detach().to(torch.float64), torch.as_tensor(loss.count, device=loss.total.device)
             .to(torch.float64)])
        dtype = torch.float32 if loss is None else loss.total.dtype
        pair, reduced = reducer.finish(grads, pair)
        return LossSum(pair[0].to(dtype), pair[1]), reduced  # the count stays on the device: never read back
    if want_loss and loss is None:
        loss = torch.zeros((), device=runner.device)
    total, reduced = reducer.finish(grads, loss if want_loss else None)
    return (None if total is None else total[0]), reduced


def sums_losses(runner: Runner, loss) -> bool:
    """Whether the runner's loss is a ``LossSum``, agreed by every rank once (a rank
    without items has no loss to look at): one all-reduce of a flag, read back once per
    runner. After that, a loss of the other kind is refused on the rank that meets it."""
    if runner.sums_losses is None:
        flag = torch.tensor([-1.0 if loss is None else float(isinstance(loss, LossSum))], device=runner.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=distributed.group())
        runner.learned_loss_kind(bool(flag.item() > 0))  # intentional sync: once per runner, to agree on the loss kind
    if loss is not None and isinstance(loss, LossSum) != runner.sums_losses:
        raise DataError(f"data parallel step: the loss returned {type(loss).__name__} where earlier steps (or other "
                        f"ranks) returned {'LossSum' if runner.sums_losses else 'a scalar'}: one loss, one kind")
    return runner.sums_losses

