"""One process's peak memory for three AdamW updates of a 210 MB MLP: the hand-written
loop with torch's fused AdamW, or leantrain's ``train_samples`` (run as ``python
memory_child.py hand|leantrain [items]``: ``items`` per update, default 1, each a batch of
8 rows; the hand loop accumulates each item's ``backward()`` into ``.grad`` and scales by
1/n; prints the peak resident memory above the baseline taken once the model exists, in
units of the parameter bytes P, and the minor page faults per update)."""

import gc
import resource
import sys

import torch

torch.set_num_threads(1)
D, LAYERS, BATCH = 2560, 8, 8


def high_water() -> int:
    """This process's peak resident bytes since it started (``VmHWM``: unlike ``ru_maxrss``,
    not carried over from the parent that forked it, whose size would hide ours)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def main(which: str, items: int = 1) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(D, D) for _ in range(LAYERS)])
    p_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    data = [(torch.randn(BATCH, D), torch.randn(BATCH, D)) for _ in range(items)]
    if which == "leantrain":
        import leantrain as lt  # imported before the baseline, as torch is
    gc.collect()
    base, faults = high_water(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    if which == "hand":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            for x, y in data:
                torch.nn.functional.mse_loss(model(x), y).backward()
            if items > 1:
                for p in model.parameters():
                    p.grad.mul_(1.0 / items)
            opt.step()
    else:
        runner = lt.Runner.from_module(model, "mse")
        cfg = lt.TrainConfig(steps=3, batch_size=items, optimizer=lt.optim.adamw(1e-4), log_every=0,
                             measure_loss=False)
        lt.train_samples(runner, cfg, data, log=None)
    peak = high_water()
    faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    print((peak - base) / p_bytes, faulted / 3)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)
