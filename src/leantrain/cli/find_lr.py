"""``leantrain find-lr``: the learning-rate range test on the job ``train`` would run (the
same flags or TOML file), written to ``OUT/lr_find.png`` and ``OUT/lr_find.json`` with
the suggested rate printed; ``leantrain find-batch-size``: the largest ``--batch-size``
that fits, written to ``OUT/batch_size.json``. The run folder's training files are not
touched."""

from __future__ import annotations

import json

from ..io.atomic import atomic_write_bytes
from ..batch_size_finder import find_batch_size
from ..data import DataLoader
from ..lr_finder import find_lr
from .runconfig import RunConfig, flag_values
from .run_folder import make_folder
from .train import EXACT_PIECES, Plan, build_job
from .usermodel import collate_for


def cmd_find_lr(args) -> int:
    cfg = RunConfig.build(args.config, flag_values(args, "train"))
    plan = Plan(cfg, False, 1, True, 0)
    job = build_job(plan)
    tcfg = job.tcfg
    result = find_lr(job.runner, job.loader, tcfg.optimizer, start_lr=args.start_lr, end_lr=args.end_lr,
                     steps=args.steps, accumulate=cfg.accumulate, autocast=tcfg.autocast,
                     clip_grad_norm=tcfg.clip_grad_norm)
    make_folder(plan.out)
    plot = result.plot(plan.out / "lr_find.png")
    _write_record(plan.out / "lr_find.json", {"lrs": list(result.lrs), "losses": list(result.losses),
                                              "smoothed": list(result.smoothed), "suggestion": result.suggestion,
                                              "diverged": result.diverged})
    how = f"stopped at {result.lrs[-1]:.3g} (the loss diverged)" if result.diverged else "the whole sweep"
    print(f"leantrain find-lr: {len(result.lrs)} updates from {args.start_lr:g} to {args.end_lr:g}, {how}")
    if result.suggestion is None:
        print("no suggestion: the loss never fell; widen the sweep (--start-lr, --end-lr) or check the data")
    else:
        print(f"suggested learning rate: {result.suggestion:.3g} (train with --lr {result.suggestion:.3g})")
    print(f"wrote {plot}, {plan.out / 'lr_find.json'}")
    return 0


def cmd_find_batch_size(args) -> int:
    cfg = RunConfig.build(args.config, flag_values(args, "train"))
    plan = Plan(cfg, False, 1, True, 0)
    job = build_job(plan)
    tcfg, dataset = job.tcfg, job.loader.dataset
    # each trial's minibatch is what --batch-size SIZE would make: cut into the same number of
    # pieces as train cuts it (one in one process), not into pieces of the configured size
    make_collate = collate_for(cfg, dataset.to_list())
    pieces = cfg.pieces or (EXACT_PIECES if cfg.exact_reduction else 1)

    def make_loader(size: int):
        return DataLoader(dataset, batch_size=size, shuffle=True, seed=cfg.seed,
                          collate=make_collate(-(-size // pieces)))

    budget = None if args.memory_budget is None else args.memory_budget * 2**20
    result = find_batch_size(job.runner, make_loader, tcfg.optimizer, start=1, max_batch_size=args.max_batch_size,
                             memory_budget=budget, steps=args.steps, accumulate=cfg.accumulate,
                             autocast=tcfg.autocast, clip_grad_norm=tcfg.clip_grad_norm)
    make_folder(plan.out)
    _write_record(plan.out / "batch_size.json", {
        "batch_size": result.batch_size, "memory_budget": budget,
        "trials": [{"batch_size": b, "peak_bytes": p, "fits": f} for b, p, f in result.trials]})
    for b, p, f in result.trials:
        peak = "out of memory" if p is None else f"{p / 2**20:.0f} MiB"
        print(f"  batch {b}: peak {peak}{'' if f else ' (does not fit)'}")
    size = result.batch_size
    print("leantrain find-batch-size: not even a batch of 1 fits the budget" if size is None
          else f"largest batch size that fits: {size} (train with --batch-size {size})")
    print(f"wrote {plan.out / 'batch_size.json'}")
    return 0


def _write_record(path, record: dict) -> None:
    """A finder's findings as JSON, written atomically."""
    atomic_write_bytes(path, (json.dumps(record, indent=1) + "\n").encode(), "--out")
