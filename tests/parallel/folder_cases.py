"""Worker for the shared-folder check: each rank trains with its checkpoints either in one
folder every rank shares, or in a folder of its own (a disk per node), and writes what
happened to ``result{rank}.txt``."""

from pathlib import Path

import torch
import torch.distributed as dist

import leantrain as lt
import shard_cases as sc


def worker(rank, world, init_file, out, per_node, sharding):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    out = Path(out)
    folder = out / (f"node{rank}" if per_node else "shared")
    try:
        torch.manual_seed(1)
        runner = lt.Runner.from_module(sc.Wide(), "mse")
        cfg = lt.TrainConfig(steps=2, batch_size=4, sharding=sharding, optimizer=lt.optim.adamw(0.01), log_every=0,
                             checkpoint_path=folder / "ck")
        before = [t.clone() for t in runner.params.values()]
        try:
            lt.train_samples(runner, cfg, sc.wide_data(), log=None)
            result = "trained"
        except lt.ConfigError as e:
            same = all(torch.equal(a, b) for a, b in zip(before, runner.params.values()))
            result = f"ConfigError unchanged={same} {e}"
        (out / f"result{rank}.txt").write_text(result)
    finally:
        dist.destroy_process_group()
