"""Plots of a run's metrics file: training loss per step, test accuracy per epoch."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError


def read_metrics(path: str | Path) -> list[dict]:
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such metrics file") from None
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            raise ConfigError(f"{path}: line {n} is not JSON") from None
        if not isinstance(rec, dict):
            raise ConfigError(f"{path}: line {n} is not a JSON object")
        records.append(rec)
    return records


def plot_metrics(metrics: str | Path, out: str | Path) -> Path:
    """Write a PNG with the loss curve (left) and test accuracy per epoch (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics)
    steps = [(r["step"], r["loss"]) for r in records if r.get("kind") == "step" and "loss" in r]
    epochs = [(r["epoch"] + 1, r["test_accuracy"]) for r in records if r.get("kind") == "epoch"]
    if not steps and not epochs:
        raise ConfigError(f"{metrics}: no step or epoch records to plot")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    if steps:
        ax1.plot(*zip(*steps), color="tab:blue", linewidth=1.2)
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("training loss (pre-update)")
    ax1.set_yscale("log")
    ax1.grid(alpha=0.3)
    if epochs:
        ax2.plot(*zip(*epochs), marker="o", color="tab:green")
    ax2.set_xlabel("epoch")
    ax2.set_ylabel("test accuracy")
    ax2.grid(alpha=0.3)
    fig.suptitle("leantrain run")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
