"""Rank-local data: each rank reads only its own items, through torch's DistributedSampler.

By default every rank reads the same batches and computes its share of each update's
items (item ``j`` on rank ``j mod W``, ``distributed.py``). A torch DataLoader whose
sampler is a ``DistributedSampler`` for this world (``num_replicas`` the world size,
``rank`` this rank) is read the way torch users mean it instead: each rank reads and
computes only the items its sampler gives it, so data loading scales with the ranks.

* An update is the union of the ranks' items, in the global order where item ``j`` is
  the ``j // W``-th item of rank ``j mod W`` (the order data parallel uses anyway), so
  ``exact_reduction`` folds exactly the items a one-process run over that order folds:
  the same bits. The mean divides by the items of all ranks (gathered each update;
  every rank must hold as many, as a ``DistributedSampler`` pads them to be).
* Buffers (BatchNorm statistics) advance on each rank's own items; rank 0's are then
  broadcast to every rank after each update, as ``DistributedDataParallel`` does
  (``broadcast_buffers=True``): they are not the one-process statistics.
* Random draws (dropout) are each rank's own (no per-item alignment across ranks).
* ``before``/``after`` are the mean over every rank's items; a resume needs the world
  size the run had (a sampler's partition depends on it).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

from . import distributed
from ..errors import ConfigError, DataError
from .measure import loss_sums
from .samples import LossSum


def samplers(loader: object) -> list:
    batch_sampler = getattr(loader, "batch_sampler", None)
    return [s for s in (getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None))
            if isinstance(s, torch.utils.data.DistributedSampler)]


def rank_local(op: str, loader: object) -> bool:
    """Whether ``loader`` gives this rank its own items (a ``DistributedSampler`` for this
    world); a sampler made for another world or rank is refused before anything changes."""
    rank, world = distributed.rank_world()
    found = samplers(loader)
    if world < 2 or not found:
        return False
    s = found[0]
    if s.num_replicas != world or s.rank != rank:
        raise ConfigError(f"{op}: the loader's DistributedSampler is for rank {s.rank} of {s.num_replicas}, but this "
                          f"process is rank {rank} of {world}; make it DistributedSampler(dataset, "
                          f"num_replicas={world}, rank={rank}) on each rank")
    return True


def global_count(runner, n: int) -> int:
    """The items of this update over all ranks; each rank must hold ``n`` (checked on
    every rank alike, so all raise together)."""
    world = distributed.rank_world()[1]
    mine = torch.tensor([n], dtype=torch.int64, device=runner.device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=distributed.group())
    counts = [int(r.item()) for r in rows]  # intentional sync: the mean's divisor is needed before it divides
    if len(set(counts)) > 1:
        raise DataError(f"rank-local data: the ranks hold {counts} items in this update; every rank must hold "
                        f"as many (a DistributedSampler pads them to be: keep each rank's batch size and "
                        f"accumulate alike)")
    return sum(counts)


def broadcast_buffers(runner) -> None:
    """Rank 0's buffers on every rank (after an update that advanced them on each rank's own items)."""
    with torch.no_grad():
        for i in runner.buffer_slots:
            s = runner.params[i].storage
            w = s.working()
            dist.broadcast(w, src=0, group=distributed.group())
            if w is s.mirror:
                s.host_current = False


def global_mean_loss(runner, samples: Iterable) -> Optional[float]:
    """The mean loss over every rank's measured items (each rank reads its own)."""
    total, n = loss_sums(runner, samples)
    if isinstance(total, LossSum):
        pair = [total.total.detach().double(), torch.as_tensor(total.count, device=runner.device).double()]
    else:
        pair = [torch.zeros((), dtype=torch.float64, device=runner.device) if total is None else total.double(),
                torch.tensor(float(n), dtype=torch.float64, device=runner.device)]
    both = torch.stack(pair)
    dist.all_reduce(both, group=distributed.group())
    total, count = both.tolist()  # intentional sync: the caller asked for the loss
    return total / count if count else 0.0
