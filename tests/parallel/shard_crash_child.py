"""A sharded run that checkpoints every step, and the points of a sharded save where the
crash test kills it (a SIGKILL the child sends itself there: no timing involved): the
step's shard file written but no index yet, the new index half written, the new index
in place but the older generation's files not yet removed."""

import os
from dataclasses import replace

import torch

import leantrain as lt
from optimizer_table import TABLE
import shard_cases as sc
from crash_child import _die  # the same SIGKILL the unsharded crash test sends

STEPS = 6
STAGES = ("shard-written", "index-half-written", "before-cleanup")


def make():
    torch.set_num_threads(1)
    torch.manual_seed(1)
    runner = lt.Runner.from_module(sc.Wide(), "mse")
    cfg = lt.TrainConfig(steps=STEPS, batch_size=3, optimizer=TABLE["adam"].make(), log_every=1,
                         sharding="gradients")
    return runner, cfg, sc.wide_data()


def train_and_checkpoint(path: str, kill_step: int, stage: str) -> None:
    from leantrain.io import atomic, sharded
    from leantrain.training.parallel.sharding import checkpoint as shard_checkpoint

    at = {"step": 0}  # the step whose save is running (set after each update)
    callback = lambda event: at.update(step=event.step)  # noqa: E731

    real_shard, real_bytes, real_remove = shard_checkpoint.write_shard, sharded.atomic_write_bytes, os.remove

    def write_shard(*args, **kwargs):
        entry = real_shard(*args, **kwargs)
        if at["step"] == kill_step and stage == "shard-written":
            _die()
        return entry

    def write_bytes(target, data, op="write"):
        if at["step"] == kill_step and stage == "index-half-written":
            def half(tmp):
                with open(tmp, "wb") as f:
                    f.write(data[: len(data) // 2])
                _die()
            return atomic.atomic_write(target, half, op)
        return real_bytes(target, data, op)

    def remove(p):
        if at["step"] == kill_step and stage == "before-cleanup":
            _die()
        real_remove(p)

    shard_checkpoint.write_shard, sharded.atomic_write_bytes, os.remove = write_shard, write_bytes, remove
    runner, cfg, data = make()
    lt.train_samples(runner, replace(cfg, checkpoint_every=1, checkpoint_path=path), data, log=None,
                     callback=callback)


def resume(path: str):
    runner, cfg, data = make()
    report = lt.train_samples(runner, replace(cfg, resume_from=path, checkpoint_every=1, checkpoint_path=path),
                              data, log=None)
    return runner.params.values(), report.losses


def straight():
    runner, cfg, data = make()
    report = lt.train_samples(runner, cfg, data, log=None)
    return runner.params.values(), report.losses
