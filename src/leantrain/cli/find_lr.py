"""``leantrain find-lr``: the learning-rate range test on the job ``train`` would run (the
same flags or TOML file), written to ``OUT/lr_find.png`` and ``OUT/lr_find.json`` with
the suggested rate printed; the run folder's training files are not touched."""

from __future__ import annotations

import json

from ..io.atomic import atomic_write_bytes
from ..lr_finder import find_lr
from .runconfig import RunConfig, flag_values
from .run_folder import make_folder
from .train import Plan, build_job


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
    record = {"lrs": list(result.lrs), "losses": list(result.losses), "smoothed": list(result.smoothed),
              "suggestion": result.suggestion, "diverged": result.diverged}
    atomic_write_bytes(plan.out / "lr_find.json", (json.dumps(record, indent=1) + "\n").encode(), "--out")
    how = f"stopped at {result.lrs[-1]:.3g} (the loss diverged)" if result.diverged else "the whole sweep"
    print(f"leantrain find-lr: {len(result.lrs)} updates from {args.start_lr:g} to {args.end_lr:g}, {how}")
    if result.suggestion is None:
        print("no suggestion: the loss never fell; widen the sweep (--start-lr, --end-lr) or check the data")
    else:
        print(f"suggested learning rate: {result.suggestion:.3g} (train with --lr {result.suggestion:.3g})")
    print(f"wrote {plot}, {plan.out / 'lr_find.json'}")
    return 0
