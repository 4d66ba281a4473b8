"""The ranks of the run-management table (``test_run_table.py``): every rank of a world runs
every case in turn, through the Python API and through the command, and writes what it
saw (its weights, its report, its warnings, its exit) to ``{out}/{world}/{case}.{rank}.json``.

The cases are the run-management features whose decisions must be the job's, not a
rank's: evaluation every N updates and per epoch, named sets, ``EarlyStopping``, a
callback's stop (rank 0's only, where callbacks run) and a step callback's stop (one rank's
only), ``keep_last``, ``keep_best`` with ``load_best_at_end``, ``max_steps``, trackers,
a resume after a run killed mid-way, ``Averaging`` (one process; refused by name on more).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import leantrain as lt
import spawning

WORLDS = (1, 2, 3)
STEPS_PER_EPOCH = 6  # 48 samples in list batches of 8 items
EPOCHS = 3


def samples(n: int = 48, shift: float = 0.0) -> list:
    g = torch.Generator().manual_seed(11)
    xs = torch.randn(n, 4, generator=g)
    return [(xs[i] + shift, xs[i].sum().reshape(1) * 0.5 + torch.sin(xs[i, :1])) for i in range(n)]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class StopAt(lt.Callback):
    """A user's callback that asks to stop after update ``step`` (it runs on rank 0 only)."""

    def __init__(self, step: int):
        self.step = step

    def on_step(self, event):
        return event.step == self.step


class Killed(RuntimeError):
    """What the injected crash raises (a run killed after an update)."""


def fingerprint(module: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(module.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def report_of(report: lt.TrainReport, out: Path) -> dict:
    return {"steps": report.steps, "samples_seen": report.samples_seen, "interrupted": report.interrupted,
            "losses": [list(x) for x in report.losses], "before": report.before, "after": report.after,
            "train_loss": report.train_loss,
            "evals": [[s, {k: v for k, v in r.items()}] for s, r in report.evals],
            "best": None if report.best_checkpoint is None else os.path.relpath(report.best_checkpoint, out),
            "resumed_from": None if report.resumed_from is None else os.path.relpath(report.resumed_from, out)}


def config(folder: Path, **kw) -> lt.LoaderTrainConfig:
    base = dict(epochs=EPOCHS, optimizer=lt.optim.adam(0.02), log_every=2, exact_reduction=True,
                eval_data=samples(16, 0.3))
    base.update(kw)
    return lt.LoaderTrainConfig(**base)


def loader():
    return lt.DataLoader(samples(), batch_size=8, shuffle=True, seed=5, collate=lt.collate.items)  # a row per item


def python_cases(folder: Path, rank: int) -> dict:
    """Each case: ``folder -> (config, callbacks, step callback)``."""
    named = {"val": samples(16, 0.3), "test": samples(8, -0.2)}
    return {
        "eval_every": lambda f: (config(f, eval_every=4), [], None),
        "eval_per_epoch_named_sets": lambda f: (config(f, eval_data=named), [], None),
        "early_stopping": lambda f: (config(f, eval_every=2), [lt.EarlyStopping(patience=1, min_delta=0.05)], None),
        "callback_stop": lambda f: (config(f, checkpoint_path=f / "ck"), [StopAt(5)], None),
        # a step callback that asks on one rank only (the last): the job stops at that update everywhere
        "step_callback_stop": lambda f: (config(f), [], lambda e: e.step == 7 and rank == dist_world() - 1),
        "keep_last": lambda f: (config(f, checkpoint_path=f / "step{step}.ckpt", checkpoint_every=3, keep_last=2),
                                [], None),
        "keep_best_load_best": lambda f: (config(f, checkpoint_path=f / "step{step}.ckpt", eval_every=3, keep_best=2,
                                                 load_best_at_end=True), [], None),
        "max_steps": lambda f: (config(f, epochs=None, max_steps=5, eval_every=2), [], None),
        "trackers": lambda f: (config(f, eval_every=3), [lt.CSVLogger(f / "csv"), lt.JSONLLogger(f / "log.jsonl")],
                               None),
    }


def dist_world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def run_python(name: str, make, folder: Path, rank: int) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = Net()
    runner = lt.Runner.from_module(model, "mse")
    cfg, callbacks, callback = make(folder)
    report, _ = lt.train_loader(runner, cfg, loader(), log=None, callbacks=callbacks, callback=callback)
    return {"weights": fingerprint(model), "report": report_of(report, folder)}


def run_resumed(folder: Path, rank: int) -> dict:
    """A run killed after update 8 (every rank: the crash injected by a step callback), then
    the same job again with ``resume_from="auto"``: it must end as one uninterrupted run."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = config(folder, checkpoint_path=folder / "step{step}.ckpt", checkpoint_every=4, keep_last=2,
                 resume_from="auto", eval_every=4)

    def killer(event):
        if event.step == 9:
            raise Killed("killed after update 8's checkpoint")

    torch.manual_seed(0)
    try:
        lt.train_loader(lt.Runner.from_module(Net(), "mse"), cfg, loader(), log=None, callback=killer)
        raise AssertionError("the injected crash did not happen")
    except Killed:
        pass
    torch.manual_seed(0)
    model = Net()
    report, _ = lt.train_loader(lt.Runner.from_module(model, "mse"), cfg, loader(), log=None)
    return {"weights": fingerprint(model), "report": report_of(report, folder)}


def run_averaging(folder: Path, rank: int) -> dict:
    """``Averaging`` runs in one process; on more, every rank refuses it before training."""
    torch.manual_seed(0)
    model = Net()
    averaged = torch.optim.swa_utils.AveragedModel(model)
    cfg = config(folder, averaging=lt.Averaging(averaged, every=2))
    try:
        report, _ = lt.train_loader(lt.Runner.from_module(model, "mse"), cfg, loader(), log=None)
    except lt.ConfigError as e:
        return {"weights": fingerprint(model), "refused": str(e).splitlines()[0]}
    return {"weights": fingerprint(model), "averaged": fingerprint(averaged), "report": report_of(report, folder)}


def run_command(args: list, folder: Path) -> dict:
    """``leantrain train`` in this rank (the process group already made, as torchrun's
    command would find it): its exit status, its console, the report it wrote."""
    from leantrain.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["train", "--preset", "digits-mlp", "--seed", "3", "--exact-reduction", "--log-every", "4",
                     "--out", str(folder), *args])
    text = (folder / "report.json").read_text() if (folder / "report.json").is_file() else "null"
    report = json.loads(text.replace(str(folder), "RUN"))  # paths named from the run folder
    for key in ("wall_time_s", "steps_per_s", "samples_per_s", "tokens_per_s", "wall_s"):
        (report or {}).pop(key, None)
    return {"exit": code, "console": out.getvalue(), "report": report}


COMMANDS = {
    "cmd_keep_best": ["--epochs", "1", "--max-steps", "12", "--eval-every", "4", "--keep-best", "loss"],
    "cmd_keep_last": ["--epochs", "1", "--max-steps", "12", "--checkpoint-every", "4", "--keep-last", "2",
                      "--log-to", "csv"],
    "cmd_max_steps": ["--epochs", "2", "--max-steps", "7"],
    "cmd_early_stop_best_k": ["--epochs", "1", "--max-steps", "30", "--eval-every", "3", "--keep-best", "loss:2",
                              "--early-stopping", "3", "--early-stopping-threshold", "2.2"],
}


def every_case(out: Path, world: int, rank: int) -> None:
    base = out / str(world)
    cases = dict(python_cases(base, rank))
    jobs = [(name, lambda name=name, make=make: run_python(name, make, base / name, rank))
            for name, make in cases.items()]
    jobs += [("resume_after_kill", lambda: run_resumed(base / "resume_after_kill", rank)),
             ("averaging", lambda: run_averaging(base / "averaging", rank))]
    jobs += [(name, lambda name=name, args=args: run_command(args, base / name)) for name, args in COMMANDS.items()]
    for name, job in jobs:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = job()
        result["warnings"] = sorted({str(w.message).splitlines()[0] for w in caught})
        (base / f"{name}.{rank}.json").write_text(json.dumps(result, sort_keys=True))


def worker(rank: int, world: int, init_file: str, out: str) -> None:
    spawning.rank_of_a_table(rank, world, init_file, out, every_case)
