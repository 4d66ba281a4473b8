"""``leantrain check``: the guarantees verified on a preset or on your own model.

Same ``model``/``data``/``loss``/optimizer keys as ``train``. Exit status 0 when every
check passes, 1 when one fails (its line gives the figure), 2 for a user error."""

from __future__ import annotations

import torch

from ..check import check
from ..training.loops.config import TrainConfig
from ..training.runner.runner import Runner
from .runconfig import RunConfig, flag_values
from .usermodel import build_task, collate_for



class RunnerFactory:
    """A runner built from a run configuration: picklable, so the resume check can
    rebuild the model in a fresh process."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg.to_dict()

    def __call__(self) -> Runner:
        factory, loss, _, _ = build_task(RunConfig(**self.cfg))
        return Runner.from_module(factory(), loss)


def cmd_check(args) -> int:
    cfg = RunConfig.build(args.config, flag_values(args, "check"))
    factory, loss, train, _ = build_task(cfg)  # user errors surface here, before any check
    items = collate_for(cfg, train)(cfg.batch_size)(train[: cfg.batch_size * 8])  # 8 minibatches
    tcfg = TrainConfig(steps=4, batch_size=2, optimizer=cfg.make_optimizer(), log_every=0)
    torch.manual_seed(cfg.seed)
    report = check(RunnerFactory(cfg), items, tcfg, seed=cfg.seed, max_ratio=args.max_ratio)
    print(f"leantrain check: {cfg.model or cfg.preset}, {cfg.optimizer} lr={cfg.lr}, "
          f"{len(items)} minibatches of {cfg.batch_size}, 2 per update")
    for line in report.lines():
        print(line)
    if args.json:
        report.write_json(args.json)
    return 0 if report.passed else 1
