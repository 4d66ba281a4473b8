"""``leantrain train`` against ``train_loader`` doing the same job with the library's
``reads_only`` callbacks (a progress bar, a JSONL logger, the test split as
``eval_data``), in the same process, interleaved.

Both train the same preset on the bundled digits (the command builds it from its flags;
the library run gets the command's own ``build_job``), logging every 5 updates, a
checkpoint every 100, an evaluation after each epoch. Per-update time: the run's wall
time (``TrainReport.wall_time``: the loop, its evaluations and checkpoints, the
``before``/``after`` losses) over its updates. Prints the best of N and the median of the
per-run ratios command/library (1.00: the command costs nothing on top), and the layouts
each built (``runner.stats``).

Run: .venv/bin/python benchmarks/command_vs_library.py [--runs 11] [--preset digits-cnn]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from contextlib import redirect_stdout
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

import leantrain as lt  # noqa: E402
from leantrain.cli import train as cli_train  # noqa: E402
from leantrain.cli.main import build_parser  # noqa: E402


def flags(preset: str, out: str) -> list[str]:
    return ["train", "--preset", preset, "--epochs", "3", "--log-every", "5", "--checkpoint-every", "100",
            "--out", out]


def command(preset: str, stats: list) -> float:
    """One command run; its per-update seconds (from its report.json)."""
    real = cli_train.build_job
    jobs = []
    cli_train.build_job = lambda plan: jobs.append(real(plan)) or jobs[-1]  # to read the runner's stats
    try:
        with tempfile.TemporaryDirectory() as d, open(os.devnull, "w") as null, redirect_stdout(null):
            assert cli_train.cmd_train(build_parser().parse_args(flags(preset, d))) == 0
            report = json.loads((Path(d) / "report.json").read_text())
    finally:
        cli_train.build_job = real
    stats.append(jobs[0].runner.stats)
    return report["wall_time_s"] / report["steps"]


def library(preset: str, stats: list) -> float:
    """The same job through ``train_loader`` with reads_only callbacks; per-update seconds."""
    with tempfile.TemporaryDirectory() as d, open(os.devnull, "w") as null, redirect_stdout(null):
        plan = cli_train.plan_run(build_parser().parse_args(flags(preset, d)))
        job = cli_train.build_job(plan)
        callbacks = [lt.ProgressBar(disable=True), lt.JSONLLogger(Path(d) / "metrics.jsonl")]
        report, _ = lt.train_loader(job.runner, job.tcfg, job.loader, log=None, callbacks=callbacks)
    stats.append(job.runner.stats)
    return report.wall_time / report.steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=11)
    ap.add_argument("--preset", default="digits-cnn")
    a = ap.parse_args()
    cmd_stats, stats, ratios, t_cmd, t_lib = [], [], [], [], []
    command(a.preset, cmd_stats), library(a.preset, stats)  # warm-up
    for r in range(a.runs):
        pair = [("cmd", lambda: command(a.preset, cmd_stats)), ("lib", lambda: library(a.preset, stats))]
        if r % 2:
            pair.reverse()
        got = {k: fn() for k, fn in pair}
        t_cmd.append(got["cmd"]), t_lib.append(got["lib"])
        ratios.append(got["cmd"] / got["lib"])
    print(f"{a.preset}, 3 epochs x 45 updates, {a.runs} interleaved runs")
    print(f"per update: command {statistics.median(t_cmd) * 1e3:.3f} ms, train_loader "
          f"{statistics.median(t_lib) * 1e3:.3f} ms (medians)")
    print(f"command / train_loader: best {min(ratios):.2f}, median {statistics.median(ratios):.2f}")
    print(f"optimizer layouts built per run: command {cmd_stats[-1].layouts}, train_loader {stats[-1].layouts}")


if __name__ == "__main__":
    main()
