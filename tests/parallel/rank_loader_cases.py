"""Rank-local reading of a leantrain DataLoader (``rank``/``world_size``): runs shared by
``test_rank_loader.py`` and its spawned workers, and the one-process references.

The data: 20 token sequences in batches of 6 (the last batch has 2), two loader batches
per update, so an update's items are shared unevenly on 3 ranks (the tail group gives
2/2/1 or 3/3/2) and the tail batch leaves rank 2 of 3 with nothing of its own batch."""

import json
from pathlib import Path

import torch
import torch.distributed as dist

import leantrain as lt
import token_cases as tc
from rank_data_cases import ACC, EPOCHS, buffers_alike, config, runner, save  # 2 epochs, 2 loader batches per update

N, BATCH, STOP = 20, 6, 3  # 2 updates per epoch: the stop is inside epoch 1


def items():
    """Dict samples (2 padded sequences each), for a loader without collate."""
    return tc.dict_items(N)


def sequences():
    return tc.sequences(N, 5)


class Counting:
    """``pad_tokens`` that counts the sequences it was given (what this rank read)."""

    def __init__(self):
        self.read = 0

    def __call__(self, batch):
        self.read += len(batch)
        return lt.collate.pad_tokens(batch)


def reference_items(path: Path, **changes) -> None:
    """One process over the same loader, no rank: every item in the one-process order."""
    r = runner()
    report, _ = lt.train_loader(r, config(**changes), lt.DataLoader(items(), BATCH, shuffle=True, seed=3), log=None)
    save(r, report, path)


def reference_collated(world: int, path: Path) -> None:
    """One process over the list batches rank-local reading makes: each batch of the
    one-process order as ``[pad(batch[r::W]) for each rank r]`` (an empty share is no item)."""
    loader, batches = lt.DataLoader(sequences(), BATCH, shuffle=True, seed=3), []
    for _ in range(EPOCHS):
        loader, raw = loader.epoch()
        batches += [[lt.collate.pad_tokens(b[r::world]) for r in range(world) if b[r::world]] for b in raw]
    r, per_epoch = runner(), len(batches) // EPOCHS
    updates = []  # the same groups of ACC batches as the loop makes, epoch by epoch
    for e in range(EPOCHS):
        mine = batches[e * per_epoch:(e + 1) * per_epoch]
        updates += [[s for b in mine[k:k + ACC] for s in b] for k in range(0, per_epoch, ACC)]
    report, _ = lt.train_loader(r, config(epochs=1, accumulate=1), updates, log=None)
    save(r, report, path)


def worker(rank, world, init_file, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    out = Path(out)

    def mine(data=None, **kw):
        return lt.DataLoader(items() if data is None else data, BATCH, shuffle=True, seed=3, rank=rank,
                             world_size=world, **kw)

    def kept(r, report, name):
        if rank == 0:
            save(r, report, out / f"{name}.w{world}.safetensors")

    try:
        r = runner()
        report, _ = lt.train_loader(r, config(), mine(), log=None)
        kept(r, report, "exact")
        r = runner()
        report, _ = lt.train_loader(r, config(exact_reduction=False, measure_loss=True), mine(), log=None)
        kept(r, report, "default")
        r = runner()  # torch's DDP over rank-local items (the tail update's shares 2/2/1 on 3 ranks)
        report, _ = lt.train_loader(r, config(exact_reduction=False, engine="ddp"), mine(), log=None)
        kept(r, report, "ddp")
        r = runner()  # sharded optimizer state and gradients over rank-local items
        report, _ = lt.train_loader(r, config(sharding="gradients"), mine(), log=None)
        kept(r, report, "sharded")
        collate = Counting()
        r = runner()
        report, _ = lt.train_loader(r, config(), mine(sequences(), collate=collate), log=None)
        kept(r, report, "collated")
        (out / f"read.w{world}.r{rank}").write_text(str(collate.read))
        if world == 2:  # stopped inside epoch 1; resumed on 3 ranks and on one process
            r = runner()
            lt.train_loader(r, config(checkpoint_path=out / "stopped.ckpt"), mine(), log=None,
                            callback=lambda e: e.step == STOP)
        else:
            r = runner()
            report, _ = lt.train_loader(r, config(resume_from=out / "stopped.ckpt"), mine(), log=None)
            kept(r, report, "resumed")
        said, calls = {}, {"other rank": lambda: lt.train_loader(runner(), config(), lt.DataLoader(
            items(), BATCH, rank=(rank + 1) % world, world_size=world), log=None)}
        if world == 3:  # the tail of 2 items alone in its update: rank 2 would have none
            calls["tail alone"] = lambda: lt.train_loader(runner(), config(accumulate=1), mine(), log=None)
        # each rank given its own items by hand, where leantrain expects every rank to read the same
        calls["own samples"] = lambda: lt.train_samples(runner(), lt.TrainConfig(steps=2, batch_size=4, log_every=0),
                                                        items()[:18][rank::world], log=None)
        calls["own batches"] = lambda: lt.train_loader(runner(), config(), [items()[rank::world][:4]], log=None)
        # engine="fsdp2" runs every item's forward on every rank: rank-local data is refused, the module kept
        kept_module = runner()
        before = {k: v.clone() for k, v in kept_module.module.state_dict().items()}
        calls["fsdp2"] = lambda: lt.train_loader(kept_module, config(exact_reduction=False, engine="fsdp2"), mine(),
                                                 log=None)
        for name, call in calls.items():
            try:
                call()
            except (lt.ConfigError, lt.DataError) as e:
                said[name] = str(e)
        said["fsdp2 kept"] = all(torch.equal(v, before[k]) for k, v in kept_module.module.state_dict().items())
        (out / f"refused.w{world}.r{rank}").write_text(json.dumps(said))
        data = [(torch.randn(2, 5), torch.randn(2, 3)) for _ in range(12)]  # BatchNorm, 6 per batch
        buffers_alike(lt.DataLoader(data, 6, shuffle=True, seed=1, rank=rank, world_size=world), rank, world, out)
    finally:
        dist.destroy_process_group()
