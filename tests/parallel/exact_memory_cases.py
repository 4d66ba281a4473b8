"""Worker for the exact reduction's memory test: three SGD updates of 16 items each on a
105 MB MLP, on one process or ``world`` gloo ranks with ``exact_reduction``; each rank
writes its peak resident memory above the baseline taken once the model exists, in units
of the parameter bytes P, to ``peak{rank}.txt``."""

import contextlib
import gc
from pathlib import Path

import torch
import torch.distributed as dist

D, LAYERS, ITEMS = 1792, 8, 16


def high_water() -> int:
    """This process's peak resident bytes since it started (``VmHWM``: unlike ``ru_maxrss``,
    not carried over from the parent that forked it, whose size would hide ours)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def job(items: int):
    """(the runner of the 105 MB MLP, ``items`` items, the parameter bytes P), garbage
    collected: the baseline is taken next."""
    import leantrain as lt

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(D, D) for _ in range(LAYERS)])
    p_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, D, generator=g), torch.randn(2, D, generator=g)) for _ in range(items)]
    runner = lt.Runner.from_module(model, "mse")
    gc.collect()
    return runner, data, p_bytes


def measure(rank: int, world: int, init_file: str, out: str) -> None:
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        import leantrain as lt

        runner, data, p_bytes = job(ITEMS)
        base = high_water()
        cfg = lt.TrainConfig(steps=3, batch_size=ITEMS, optimizer=lt.optim.sgd(1e-3), log_every=0,
                             measure_loss=False, exact_reduction=world > 1)
        lt.train_samples(runner, cfg, data, log=None)
        peak = high_water()
        (Path(out) / f"peak{rank}-of-{world}.txt").write_text(str((peak - base) / p_bytes))
    finally:
        if world > 1:
            dist.destroy_process_group()


def resident() -> int:
    """This process's resident bytes now (``VmRSS``)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def measure_sharded(rank: int, world: int, init_file: str, out: str, mode: str) -> None:
    """Three AdamW updates of 4 items, clipped by norm, under ``sharding=mode`` on ``world``
    gloo ranks (one: a one-rank plan). Each rank writes, in units of P above the baseline,
    its peak and what it holds once an update's gradient is reduced (resident memory when
    the strategy's ``mean`` returns, the largest of the updates) to
    ``peak{rank}-{mode}-of-{world}.txt`` as ``peak held``."""
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        import leantrain as lt
        from leantrain.training.parallel.sharding.reduction import Sharded

        runner, data, p_bytes = job(4)
        base = high_water()
        held = []
        reduce = Sharded.mean

        def mean(self, *args, **kwargs):
            out = reduce(self, *args, **kwargs)
            held.append(resident() - base)
            return out

        Sharded.mean = mean  # this spawned process's class only
        cfg = lt.TrainConfig(steps=3, batch_size=4, optimizer=lt.optim.adamw(1e-3), log_every=0,
                             measure_loss=False, clip_grad_norm=1.0, sharding=mode, replica_check=False)
        lt.train_samples(runner, cfg, data, log=None)
        peak = high_water()
        (Path(out) / f"peak{rank}-{mode}-of-{world}.txt").write_text(f"{(peak - base) / p_bytes} {max(held) / p_bytes}")
    finally:
        if world > 1:
            dist.destroy_process_group()



def measure_whole(rank: int, world: int, init_file: str, out: str, mode: str, bucket_bytes: int = 0) -> None:
    """Two AdamW updates of 4 items under ``sharding=mode`` on ``world`` gloo ranks; each
    rank writes its peak resident memory above what the process held before the model
    existed (the parameters included: parameter sharding releases them), in units of P,
    to ``whole{rank}-{mode}-of-{world}.txt``. ``bucket_bytes``: the reduce-scatter's
    buckets and its bound in flight set to that many bytes (0: as shipped)."""
    with ranks(rank, world, init_file, bucket_bytes):
        import leantrain as lt

        gc.collect()
        start = high_water()
        runner, data, p_bytes = job(4)
        cfg = lt.TrainConfig(steps=2, batch_size=4, optimizer=lt.optim.adamw(1e-3), log_every=0,
                             measure_loss=False, sharding=mode, replica_check=False)
        lt.train_samples(runner, cfg, data, log=None)
        (Path(out) / f"whole{rank}-{mode}-of-{world}.txt").write_text(str((high_water() - start) / p_bytes))


@contextlib.contextmanager
def ranks(rank: int, world: int, init_file: str, bucket_bytes: int = 0):
    """This process as rank ``rank`` of ``world`` gloo ranks (none for one), one thread; with
    ``bucket_bytes`` the reduce-scatter's buckets and its bound in flight set to that many bytes
    (0: as shipped)."""
    from leantrain.training.parallel import overlap
    from leantrain.training.parallel.sharding import overlap as shard_overlap

    if bucket_bytes:
        overlap.FIRST_BUCKET_BYTES = overlap.BUCKET_BYTES = shard_overlap.IN_FLIGHT = bucket_bytes
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        if world > 1:
            dist.destroy_process_group()


def measure_finish(rank: int, world: int, init_file: str, out: str) -> None:
    """Two AdamW updates of 4 items under ``sharding="parameters"`` on ``world`` gloo
    ranks; each rank writes how far its resident memory rises above what it held when the
    run's end began (the strategy's ``finish``: the module gathered whole again), in P,
    to ``finish{rank}-of-{world}.txt``. The peak is restarted there (``clear_refs``)."""
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        import leantrain as lt
        from leantrain.training.parallel.sharding.strategy import ShardedStrategy

        runner, data, p_bytes = job(4)
        rise = []
        end = ShardedStrategy.finish

        def finish(self, runner):
            gc.collect()
            before = resident()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM restarts from the resident size now
            end(self, runner)
            rise.append(high_water() - before)

        ShardedStrategy.finish = finish  # this spawned process's class only
        cfg = lt.TrainConfig(steps=2, batch_size=4, optimizer=lt.optim.adamw(1e-3), log_every=0,
                             measure_loss=False, sharding="parameters", replica_check=False)
        lt.train_samples(runner, cfg, data, log=None)
        (Path(out) / f"finish{rank}-of-{world}.txt").write_text(str(rise[0] / p_bytes))
    finally:
        if world > 1:
            dist.destroy_process_group()



def _sharded_mlp_run(rank: int, world: int, init_file: str, bucket_bytes: int, meta: bool, result: Path,
                     **settings) -> None:
    """The MLP (built on meta, or whole) trained under ``sharding="parameters"`` on
    ``world`` gloo ranks with ``settings``; ``result`` gets the peaks above what the
    process held before the model existed, in P: when its first update begins, and when
    the run has ended (its end and final checkpoint included)."""
    with ranks(rank, world, init_file, bucket_bytes):  # 4 MiB buckets, as measure_whole
        import leantrain as lt
        from leantrain.training.loops.session import Session

        gc.collect()
        start = high_water()
        torch.manual_seed(0)
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = torch.nn.Sequential(*[torch.nn.Linear(D, D) for _ in range(LAYERS)])
        p_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(2, D, generator=g), torch.randn(2, D, generator=g)) for _ in range(4)]
        runner = lt.Runner.from_module(model, "mse")
        begun = []
        update = Session.update

        def first(self, *args, **kwargs):
            if not begun:
                begun.append(high_water() - start)
            return update(self, *args, **kwargs)

        Session.update = first  # this spawned process's class only
        cfg = lt.TrainConfig(batch_size=4, optimizer=lt.optim.adamw(1e-3), log_every=0, measure_loss=False,
                             sharding="parameters", replica_check=False, **settings)
        lt.train_samples(runner, cfg, data, log=None)
        result.write_text(f"{begun[0] / p_bytes} {(high_water() - start) / p_bytes}")


def measure_meta(rank: int, world: int, init_file: str, out: str, meta: bool = True, bucket_bytes: int = 4 << 20
                 ) -> None:
    """Two AdamW updates of 4 items of the MLP built on torch's meta device and filled by
    each Linear's own ``reset_parameters`` (``meta=False``: built whole, as ``measure_whole``),
    the checkpoint in ``meta-<meta>-<world>``; the peaks to ``meta{rank}-{meta}-of-{world}.txt``."""
    extra = dict(init_weights="reset_parameters") if meta else dict(gather_at_end=False)
    _sharded_mlp_run(rank, world, init_file, bucket_bytes, meta, Path(out) / f"meta{rank}-{meta}-of-{world}.txt",
                     steps=2, checkpoint_path=Path(out) / f"meta-{meta}-{world}", **extra)


def measure_resume(rank: int, world: int, init_file: str, out: str, source: str, bucket_bytes: int = 4 << 20) -> None:
    """The meta-built MLP resumed from the folder ``source`` (``measure_meta``'s, saved after
    its 2 updates on any world size) for 2 more updates; the peaks to ``resume{rank}-of-{world}.txt``."""
    _sharded_mlp_run(rank, world, init_file, bucket_bytes, True, Path(out) / f"resume{rank}-of-{world}.txt",
                     steps=4, checkpoint_path=Path(out) / f"resumed-{world}", resume_from=source)
