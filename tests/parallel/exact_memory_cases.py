"""Worker for the exact reduction's memory test: three SGD updates of 16 items each on a
105 MB MLP, on one process or ``world`` gloo ranks with ``exact_reduction``; each rank
writes its peak resident memory above the baseline taken once the model exists, in units
of the parameter bytes P, to ``peak{rank}.txt``."""

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


def measure(rank: int, world: int, init_file: str, out: str) -> None:
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        import leantrain as lt

        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(D, D) for _ in range(LAYERS)])
        p_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(2, D, generator=g), torch.randn(2, D, generator=g)) for _ in range(ITEMS)]
        runner = lt.Runner.from_module(model, "mse")
        gc.collect()
        base = high_water()
        cfg = lt.TrainConfig(steps=3, batch_size=ITEMS, optimizer=lt.optim.sgd(1e-3), log_every=0,
                             measure_loss=False, exact_reduction=world > 1)
        lt.train_samples(runner, cfg, data, log=None)
        peak = high_water()
        (Path(out) / f"peak{rank}-of-{world}.txt").write_text(str((peak - base) / p_bytes))
    finally:
        if world > 1:
            dist.destroy_process_group()
