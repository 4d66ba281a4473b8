"""Rank-local data: each rank reads only its own items.

By default every rank reads the same batches and computes its share of each update's
items (item ``j`` on rank ``j mod W``, ``distributed.py``). Two loaders are read the
way a sharded loader is meant instead, each rank reading and computing only its items,
so data loading scales with the ranks:

* a torch DataLoader whose sampler is a ``DistributedSampler`` for this world
  (``num_replicas`` the world size, ``rank`` this rank), as torch users write it;
* a ``leantrain.DataLoader`` made with ``rank`` and ``world_size`` (this rank of this
  world): each rank reads the items ``rank, rank + W, ...`` of every batch of the
  one-process order, exactly the items data parallel gives it, and collates only them.

* An update is the union of the ranks' items, in the global order where item ``j`` is
  the ``j // W``-th item of rank ``j mod W`` (the order data parallel uses anyway), so
  ``exact_reduction`` folds exactly the items a one-process run over that order folds:
  the same bits. The mean divides by the items of all ranks (gathered each update;
  every rank must hold at least one, and the counts must be those of that order: equal,
  as a ``DistributedSampler`` pads them to be, or one more on the first ranks, as a
  leantrain loader's short last batch gives).
* Buffers (BatchNorm statistics) advance on each rank's own items; rank 0's are then
  broadcast to every rank after each update, as ``DistributedDataParallel`` does
  (``broadcast_buffers=True``): they are not the one-process statistics.
* Random draws (dropout) are each rank's own (no per-item alignment across ranks).
* ``before``/``after`` are the mean over every rank's items. A ``DistributedSampler``
  run resumes at the world size it had (the sampler's partition depends on it); a
  leantrain loader's position is that of one process, so its run resumes at any world
  size whose ranks can share its batches.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

from . import distributed
from ...data import DataLoader
from ...errors import ConfigError, DataError
from ...io.checkfile import checksum
from ..runner.measure import loss_sums
from ...samples import LossSum


def samplers(loader: object) -> list:
    batch_sampler = getattr(loader, "batch_sampler", None)
    return [s for s in (getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None))
            if isinstance(s, torch.utils.data.DistributedSampler)]


def rank_local(op: str, loader: object, accumulate: int = 1, pieces: Optional[int] = None) -> bool:
    """Whether ``loader`` gives this rank its own items (a ``DistributedSampler`` for this
    world, or a ``leantrain.DataLoader`` made for this rank); a loader made for another
    world or rank is refused before anything changes."""
    rank, world = distributed.rank_world()
    if isinstance(loader, DataLoader):
        return _leantrain_local(op, loader, rank, world, accumulate, pieces)
    found = samplers(loader)
    if world < 2 or not found:
        return False
    s = found[0]
    if s.num_replicas != world or s.rank != rank:
        raise ConfigError(f"{op}: the loader's DistributedSampler is for rank {s.rank} of {s.num_replicas}, but this "
                          f"process is rank {rank} of {world}; make it DistributedSampler(dataset, "
                          f"num_replicas={world}, rank={rank}) on each rank")
    return True


def _leantrain_local(op: str, loader: DataLoader, rank: int, world: int, accumulate: int,
                     pieces: Optional[int]) -> bool:
    """A leantrain loader made with ``rank``/``world_size`` must be for this process, and
    every update must give the ranks items in the order's counts (known from the sizes,
    nothing read)."""
    if loader.world_size is None or (loader.world_size == 1 and world == 1):
        return False
    if (loader.rank, loader.world_size) != (rank, world):
        raise ConfigError(f"{op}: the DataLoader is made for rank {loader.rank} of {loader.world_size}, but this "
                          f"process is rank {rank} of {world}; make it DataLoader(..., rank={rank}, "
                          f"world_size={world}) on each rank")
    n, b = len(loader.dataset), loader.batch_size
    tail = 0 if loader.drop_last else n % b
    if 0 < tail < world and (n // b) % accumulate == 0:  # the short last batch is an update of its own
        raise ConfigError(f"{op}: the last batch of each epoch holds {tail} item(s) for {world} ranks, so a rank "
                          f"would have none in that update; pass drop_last=True, or a batch_size that leaves no "
                          f"tail shorter than the world size ({n} items)")
    if pieces is not None and tail % world:
        raise ConfigError(f"{op}: pieces={pieces} cuts each rank's items, but the last batch of each epoch holds "
                          f"{tail} item(s), which {world} ranks cannot share equally; pass drop_last=True, or a "
                          f"batch_size that divides the {n} items")
    return True


def global_count(runner, n: int) -> int:
    """The items of this update over all ranks. Item ``j`` of the update is rank ``j mod
    W``'s, so the counts must be those of that order (equal, or one more on the first
    ranks) and none zero: checked on every rank alike, so all raise together."""
    world = distributed.rank_world()[1]
    mine = torch.tensor([n], dtype=torch.int64, device=runner.device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=distributed.group())
    counts = [int(r.item()) for r in rows]  # intentional sync: the mean's divisor is needed before it divides
    total = sum(counts)
    if min(counts) == 0 or counts != [len(range(r, total, world)) for r in range(world)]:
        raise DataError(f"rank-local data: the ranks hold {counts} items in this update; item j of an update is "
                        f"rank (j mod {world})'s, so every rank must hold at least one and as many as the ranks "
                        f"before it or one fewer (a DistributedSampler pads them to be equal: keep each rank's "
                        f"batch size and accumulate alike; a leantrain DataLoader's collate must make as many "
                        f"items of each rank's share)")
    return total


def fingerprint(batch: list) -> list:
    """What the ranks compare of a shared batch: per item, the CRC-32C of each tensor
    leaf's bytes (with its shape), in order. Reads the tensors back (once per loop)."""
    def leaf(x):
        if isinstance(x, torch.Tensor):
            return [tuple(x.shape), str(x.dtype), checksum(x.detach().to("cpu"))]
        if isinstance(x, dict):
            return [[k, leaf(v)] for k, v in x.items()]
        if isinstance(x, (tuple, list)):
            return [leaf(v) for v in x]
        return type(x).__name__

    return [leaf(s) for s in batch]


def agree_on_batch(op: str, batch: list) -> None:
    """Under ``torch.distributed``, without rank-local data every rank must read the same
    batches (each computes its share of them): the first update's batch is compared once
    per loop, so ranks given different data (a list or stream cut per rank by hand, which
    would train on a mix of the ranks' items) all stop there with the remedy."""
    group = distributed.active()
    if group is None:
        return
    everyone: list = [None] * group[1]
    dist.all_gather_object(everyone, fingerprint(batch), group=distributed.group())  # intentional sync: once per loop
    differ = [r for r, f in enumerate(everyone) if f != everyone[0]]
    if differ:
        raise DataError(f"{op}: ranks {differ} read a first batch that differs from rank 0's; without rank-local data "
                        f"every rank reads the same batches and computes its share of each (item j on rank j mod "
                        f"{group[1]}). Give every rank the same data, or let each read its own: a torch DataLoader "
                        f"with a DistributedSampler, or DataLoader(..., rank=, world_size=)")


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
