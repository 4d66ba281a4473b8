"""A spawned worker whose ranks are given different numbers of items (tests/test_rank_agreement.py)."""

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import leantrain as lt


def worker(rank, world, init_file, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        r = lt.Runner.from_module(nn.Linear(3, 2), "mse")
        g = torch.Generator().manual_seed(1)
        samples = [(torch.randn(2, 3, generator=g), torch.randn(2, 2, generator=g)) for _ in range(6 + 2 * rank)]
        try:
            lt.train_samples(r, lt.TrainConfig(steps=3, batch_size=2, log_every=0), samples)
            result = "trained"
        except lt.ConfigError as e:
            result = str(e)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
