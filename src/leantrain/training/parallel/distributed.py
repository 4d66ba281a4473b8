"""Data parallelism on ``torch.distributed`` (gloo on CPU, NCCL on CUDA).

When a process group of more than one rank is initialised, every list batch is
split across ranks by a fixed rule: **item j goes to rank j mod world_size**. Every
rank advances buffers on *all* items (so buffers stay identical everywhere and equal
to a single-process run), differentiates its own items and sums their gradient packs
left to right; all-reduces of flat gradient buckets, each started while the last
item's backward still runs (``overlap.py``), give the global sum; every rank
multiplies by ``1/N`` (N = items in the whole batch) and takes the same optimizer
step. The loss joins the all-reduce only when a step asked for it.
Rank 0 writes logs and checkpoints. Because batches are defined globally, a
checkpoint resumes under any world size.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from ...errors import CheckpointError, CollectiveError, ConfigError, LeantrainError, ReplicaError

__all__ = ["CollectiveError", "ReplicaError"]  # public in leantrain.errors; here too, where they were first


DEFAULT_TIMEOUT = 300.0  # seconds a collective may wait for the slowest rank

# The group leantrain's collectives run on while a loop runs (None: the default group).
_group = None
# The group the job's decisions travel on (host memory, gloo): ``None`` where ``_group`` is gloo already.
_host = None


def from_a_collective(e: BaseException) -> bool:
    """Whether ``e`` came out of a collective operation (a peer died, stopped or timed out)
    rather than from the user's model, loss or data: torch's distributed error types, or a
    traceback that passes through ``torch.distributed``, or one whose innermost frame is
    leantrain's own collective code (an async ``work.wait()``). An error raised in the
    model's forward or backward ends in the user's code, ``torch.nn`` or autograd."""
    if isinstance(e, LeantrainError):
        return False
    if isinstance(e, tuple(t for t in (getattr(dist, "DistError", None),) if t is not None)):
        return True
    tb, last = e.__traceback__, ""
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename.replace(os.sep, "/")
        if "/torch/distributed/" in last:
            return True
        tb = tb.tb_next
    return "/leantrain/training/parallel/" in last


@contextlib.contextmanager
def collectives(timeout: Optional[float]) -> Iterator[None]:
    """Run the enclosed loop's collectives on a group of every rank whose operations
    fail after ``timeout`` seconds (``None``: the default group and its own timeout),
    so a stopped or dead peer is an error in minutes, not a hang of torch's default."""
    global _group, _host
    if active() is None:
        yield
        return
    extra = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    group = None if timeout is None else dist.new_group(**extra)  # every rank calls this
    # The job's decisions (a stop, rank 0's results) are host data: on gloo, never through a device (NCCL).
    host = None if dist.get_backend(group) == "gloo" else dist.new_group(backend="gloo", **extra)
    (previous, previous_host), _group, _host = (_group, _host), group, host
    failed = False
    try:
        yield
    except BaseException:
        failed = True  # a group whose peer is gone may not tear down cleanly: leave it
        raise
    finally:
        _group, _host = previous, previous_host
        if not failed and (group is not None or host is not None):
            # every rank past the loop's last message first: a gloo group torn down while a peer still
            # read its tail killed that peer (std::system_error, SIGABRT, in about half of 10 loops in a
            # row of a 1M-parameter model on 2 gloo ranks); the barrier on host memory (gloo)
            dist.barrier(group=host if host is not None else group)
            for made in (group, host):
                if made is not None:
                    dist.destroy_process_group(made)


def group():
    """The process group leantrain's collectives use now (``None``: the default group)."""
    return _group


def active() -> Optional[tuple[int, int]]:
    """``(rank, world_size)`` when a process group of more than one rank is running."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return None


def any_rank(flag: bool) -> bool:
    """Whether any rank says ``flag``: one decision for the job (a stop), the same on every
    rank (a collective of host memory: no device sync; one process: ``flag``)."""
    if active() is None:
        return bool(flag)
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_host if _host is not None else _group)
    return bool(t.item())  # a host tensor: no device read


def from_main(value):
    """Rank 0's ``value`` on every rank (a collective of host memory; one process: ``value``)."""
    if active() is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=_host if _host is not None else _group)
    return box[0]


def rank_world() -> tuple[int, int]:
    """``(rank, world_size)``, ``(0, 1)`` when not distributed."""
    return active() or (0, 1)


def is_main() -> bool:
    """True on rank 0, or when not distributed: the process that logs and writes files."""
    group = active()
    return group is None or group[0] == 0


def my_items(batch: Sequence, rank: int, world: int) -> list:
    """This rank's share of a list batch: items ``rank, rank + world, ...``."""
    return list(batch[rank::world])


def everyone(value) -> list:
    """``value`` from every rank, in rank order (a collective; one process: ``[value]``)."""
    if active() is None:
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=_group)
    return out


def broadcast_parameters(params, skip: frozenset = frozenset()) -> None:
    """Copy rank 0's values into every rank's working tensors (host or mirror); storages
    whose host tensor's id is in ``skip`` (unfilled: no values yet) are left alone."""
    with torch.no_grad():
        for s in params.storages():
            if id(s.host) in skip:
                continue
            w = s.working()
            dist.broadcast(w, src=0, group=_group)
            if w is s.mirror:
                s.host_current = False  # the mirror was written: the host copy may be stale


def check_replicas(params, op: str = "check_replicas", skip: frozenset = frozenset()) -> None:
    """Raise ``ReplicaError`` unless every rank holds bit-identical parameters (but the
    unfilled storages in ``skip``).

    Reads every value to the host once (a sync on CUDA): run at start and after resume.
    """
    from ...io.checkfile import checksum
    from ...io.checkpoint import current_value

    sums = [None if id(s.host) in skip else checksum(current_value(s)) for s in params.storages()]
    gathered = everyone(sums)
    for rank, other in enumerate(gathered):
        if other != gathered[0]:
            bad = [k for k, (a, b) in enumerate(zip(gathered[0], other)) if a != b]
            raise ReplicaError(f"{op}: rank {rank} differs from rank 0 at storages {bad}")


def agree(op: str, what: dict) -> None:
    """Raise on every rank (the same ``ConfigError``) unless all ranks run the same loop:
    ``what`` (the number of items, the batch size, the settings a resume compares) is
    gathered from each; otherwise one rank would fail and another train alone."""
    group = active()
    if group is None:
        if what.get("refused"):
            raise CheckpointError(what["refused"])
        return
    pairs: list = [None] * group[1]
    dist.all_gather_object(pairs, (what, socket.gethostname()), group=_group)
    refused = next((w["refused"] for w, _ in pairs if w.get("refused")), None)
    if refused:  # rank 0 cannot write where the checkpoints go (another run does): every rank says so
        raise CheckpointError(refused)
    everyone = [{k: v for k, v in w.items() if k != "refused"} for w, _ in pairs]
    if any(other != everyone[0] for other in everyone):
        differ = sorted({k for other in everyone for k in set(other) | set(everyone[0])
                         if other.get(k) != everyone[0].get(k)})
        shown = "; ".join(f"rank {r} on {pairs[r][1]}: " + ", ".join(f"{k}={o.get(k)!r}" for k in differ)
                          for r, o in enumerate(everyone))
        hint = "give every rank the same data and settings"
        if "resume" in differ:  # a relaunch whose ranks see different checkpoint folders
            hint = ("some ranks found a checkpoint to resume and others did not: the checkpoint folder is not "
                    "the same on every node (did rank 0 move to another node?); relaunch with rank 0 on the node "
                    "that holds the checkpoints, or keep them in a folder every node shares")
        raise ConfigError(f"{op}: the ranks run different loops ({shown}); {hint}")


def check_shared_folder(op: str, path) -> None:
    """Every rank sees the files rank 0 writes where the run's checkpoints go (the folder of
    ``path``), or every rank raises the same ``ConfigError`` naming the ranks that do not: a
    sharded run's folder on a disk of its own per node would save without complaint, but
    no resume could load what it holds (its shards spread over the nodes)."""
    group = active()
    if group is None or path is None:
        return
    rank, world = group
    folder = Path(path).parent
    made = None
    if rank == 0:
        made = f".leantrain-probe-{os.urandom(6).hex()}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / made).touch()
        except OSError as e:
            made = OSError(f"{folder}: {e.strerror or e}")
    first: list = [None] * world
    dist.all_gather_object(first, made, group=_group)  # rank 0's probe exists before anyone looks
    probe = first[0]
    if isinstance(probe, OSError):
        raise ConfigError(f"{op}: checkpoint_path: rank 0 cannot write where the checkpoints go ({probe})")
    seen: list = [None] * world
    dist.all_gather_object(seen, ((folder / probe).exists(), socket.gethostname()), group=_group)
    if rank == 0:
        (folder / probe).unlink(missing_ok=True)
    blind = [r for r, (s, _) in enumerate(seen) if not s]
    if blind:
        nodes = sorted({seen[r][1] for r in blind})
        raise ConfigError(
            f"{op}: checkpoint_path {path}: rank(s) {blind} of {world} (on {', '.join(nodes)}) do not see the files "
            f"rank 0 (on {seen[0][1]}) writes in {folder} (a disk of its own on each node?); a run's checkpoints "
            f"must be in a folder every rank shares, or no resume can load them: point --out (checkpoint_path) "
            f"at a shared file system")


def start_replicas(runner, check: bool = True) -> None:
    """At the start of a loop (and after a resume): broadcast from rank 0, then verify."""
    if active() is None:
        return
    skip = frozenset(runner.unfilled)  # a model built on meta: filled on every rank alike (sharding/fill.py)
    broadcast_parameters(runner.params, skip)
    if check:
        check_replicas(runner.params, "distributed start", skip)


def join_launcher(op: str, device: torch.device, timeout: Optional[float]) -> None:
    """A process torchrun started (``WORLD_SIZE`` > 1 in its environment) whose script made
    no process group joins its job: leantrain initialises torch's default group from
    torchrun's environment (as the command does; it stays initialised, as the script had
    made it), so the ranks train one run, never N runs in one folder. An environment
    that names a world but not how to meet is refused, naming ``init_process_group``."""
    size = os.environ.get("WORLD_SIZE")
    if size is None or not dist.is_available() or dist.is_initialized():
        return
    if not size.strip().isdigit():
        raise ConfigError(f"{op}: WORLD_SIZE={size!r} in the environment is not a number of processes")
    if int(size) <= 1:
        return
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    local = os.environ.get("LOCAL_RANK", "0")
    if missing:
        raise ConfigError(f"{op}: WORLD_SIZE={size} says this process is one of {size}, but {', '.join(missing)} "
                          f"is not set (not a torchrun launch?): call torch.distributed.init_process_group(...) "
                          f"before training, or launch with torchrun")
    if device.type == "cuda" and device.index is not None and str(device.index) != local:
        raise ConfigError(f"{op}: this process is torchrun's local rank {local} but its model is on {device}: put "
                          f"each rank's model on cuda:{local} (torch.cuda.set_device(int(os.environ['LOCAL_RANK'])))")
    init_from_env("cuda" if device.type == "cuda" else "cpu", timeout)


def init_from_env(device: str = "cpu", timeout: Optional[float] = DEFAULT_TIMEOUT) -> bool:
    """Initialise the process group from torchrun's environment, its collectives failing
    after ``timeout`` seconds (``None``: torch's default); False when not launched by
    torchrun (or with one process)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or (dist.is_available() and dist.is_initialized()):
        return active() is not None
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    extra = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    dist.init_process_group(backend=backend, **extra)
    return True
