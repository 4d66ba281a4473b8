"""Rank-local data runs (each rank reads its own items through a DistributedSampler),
shared by ``test_rank_data.py`` and its spawned workers, and the one-process reference
that folds the same items in the same global order."""

from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import leantrain as lt
import shard_cases as sc
import token_cases as tc

EPOCHS, ACC, STOP = 2, 2, 4  # 3 updates per epoch on 2 ranks: the stop is mid-epoch 1


def sampler_loader(rank: int, world: int) -> DataLoader:
    data = tc.sequences(24, 4)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=1)
    return DataLoader(data, batch_size=2, sampler=sampler, collate_fn=lt.collate.pad_tokens)


def config(**changes) -> lt.LoaderTrainConfig:
    base = dict(epochs=EPOCHS, accumulate=ACC, optimizer=lt.optim.adamw(0.05, weight_decay=0.01), log_every=1,
                exact_reduction=True, measure_loss=False)
    return lt.LoaderTrainConfig(**dict(base, **changes))


def runner():
    torch.manual_seed(0)
    return lt.Runner.from_module(tc.TinyLM(), "model")


def save(r, report, path: Path) -> None:
    values = {f"w.{k}": v.detach().clone() for k, v in r.module.state_dict().items()}
    values["losses"] = torch.tensor([loss for _, loss in report.losses], dtype=torch.float64)
    save_file(values, str(path))


def same_bits(a: Path, b: Path) -> None:
    """Two saved runs (``save``) hold the same bits, and at least 4 logged losses."""
    ta, tb = load_file(str(a)), load_file(str(b))
    assert sorted(ta) == sorted(tb) and len(ta["losses"]) >= 4
    for k in ta:
        assert torch.equal(ta[k].contiguous().view(torch.uint8), tb[k].contiguous().view(torch.uint8)), k


def reference(world: int, path: Path) -> None:
    """One process, one list batch per update: item j is rank (j mod W)'s (j // W)-th."""
    updates = []
    for epoch in range(EPOCHS):
        per_rank = []
        for r in range(world):
            loader = sampler_loader(r, world)
            loader.sampler.set_epoch(epoch)
            per_rank.append(list(loader))
        for u in range(len(per_rank[0]) // ACC):
            updates.append([per_rank[j % world][u * ACC + j // world] for j in range(ACC * world)])
    r = runner()
    report, _ = lt.train_loader(r, config(epochs=1, accumulate=1), updates, log=None)
    save(r, report, path)


def bn_loader(rank: int, world: int) -> DataLoader:
    g = torch.Generator().manual_seed(3)
    ds = TensorDataset(torch.randn(24, 5, generator=g), torch.randn(24, 3, generator=g))
    return DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, num_replicas=world, rank=rank, seed=2))


def buffers_alike(loader, rank: int, world: int, out: Path) -> None:
    """Train a BatchNorm model over a rank-local ``loader`` and write (rank 0) whether
    every rank ends with the same parameters and buffers (rank 0's buffers are broadcast
    after each update)."""
    bn = lt.Runner.from_module(sc.Wide(), "mse")
    lt.train_loader(bn, lt.LoaderTrainConfig(epochs=2, optimizer=lt.optim.sgd(0.1), log_every=0), loader, log=None)
    sums = [float(v.storage.host.double().sum()) for v in bn.params]
    everyone = [None] * world
    dist.all_gather_object(everyone, sums)
    if rank == 0:
        (out / f"bn.w{world}").write_text(str(all(e == everyone[0] for e in everyone)))


def worker(rank, world, init_file, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    out = Path(out)
    try:
        r = runner()
        report, _ = lt.train_loader(r, config(), sampler_loader(rank, world), log=None)
        if rank == 0:
            save(r, report, out / f"local.w{world}.safetensors")
        r = runner()  # with sharded optimizer state and gradients too
        report, _ = lt.train_loader(r, config(sharding="gradients"), sampler_loader(rank, world), log=None)
        if rank == 0:
            save(r, report, out / f"sharded.w{world}.safetensors")
        r = runner()  # the default reduction, sharded: the ranks' own items reduce-scattered
        report, _ = lt.train_loader(r, config(sharding="gradients", exact_reduction=False), sampler_loader(rank, world),
                                    log=None)
        if rank == 0:
            save(r, report, out / f"sharded-default.w{world}.safetensors")
        if world == 2:  # stop after STOP updates, then resume in a fresh runner
            r = runner()
            lt.train_loader(r, config(checkpoint_path=out / "stopped"), sampler_loader(rank, world), log=None,
                            callback=lambda e: e.step == STOP)
            r = runner()
            report, _ = lt.train_loader(r, config(resume_from=out / "stopped"), sampler_loader(rank, world), log=None)
            if rank == 0:
                save(r, report, out / "resumed.w2.safetensors")
        try:  # a sampler made for another rank: refused on every rank before anything changes
            lt.train_loader(runner(), config(), sampler_loader((rank + 1) % world, world), log=None)
        except lt.ConfigError as e:
            (out / f"refused.w{world}.r{rank}").write_text(str(e))
        buffers_alike(bn_loader(rank, world), rank, world, out)
    finally:
        dist.destroy_process_group()
