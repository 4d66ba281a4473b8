"""Plots of a run's metrics file: training loss per update, the evaluations' accuracy (or
loss) per update."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import ConfigError
from ..training.loops.loggers import step_offset
from ..validate import is_number


FORMATS = (".png", ".svg", ".pdf")
# The fields a record of a kind must have to be drawn (``JSONLLogger`` writes them all).
FIELDS = {"step": ("step", "loss"), "eval": ("step",), "epoch": ("epoch",)}


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics file (or of a run folder's ``metrics.jsonl``)."""
    p = Path(path)
    if p.is_dir():
        if not (p / "metrics.jsonl").is_file():
            raise ConfigError(f"{path}: a folder without metrics.jsonl; give a metrics file or a run folder")
        p = p / "metrics.jsonl"
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such metrics file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (expected one JSON record per line)") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror or e})") from None
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            raise ConfigError(f"{path}: line {n} is not JSON") from None
        if not isinstance(rec, dict):
            raise ConfigError(f"{path}: line {n} is not a JSON object")
        missing = [k for k in FIELDS.get(rec.get("kind"), ()) if k not in rec]
        if missing:
            raise ConfigError(f"{path}: line {n}: a {rec['kind']!r} record without {', '.join(map(repr, missing))}")
        records.append(rec)
    return records


def _points(metrics, records: list[dict], kind: str, x: str, y: str) -> list[tuple[float, float]]:
    """(x, y) of each ``kind`` record that has ``y``; both must be numbers."""
    out = []
    for r in records:
        if r.get("kind") != kind or y not in r:
            continue
        a, b = r.get(x), r.get(y)
        if not (is_number(a) and is_number(b)):
            raise ConfigError(f"{metrics}: a {kind!r} record has {x}={a!r:.40}, {y}={b!r:.40}; expected numbers")
        if not (0 <= a < 2**53 and (not isinstance(a, float) or a.is_integer())):
            raise ConfigError(f"{metrics}: a {kind!r} record has {x}={a!r:.40}; expected a count below 2**53")
        try:
            value = float(b)
        except OverflowError:
            raise ConfigError(f"{metrics}: a {kind!r} record has {y}={b!r:.40}; expected a float") from None
        if math.isfinite(value):  # a diverged step (inf, NaN) has no point to draw
            out.append((int(a), value))
    return out


def output_path(out: str | Path) -> Path:
    """Where the plot goes: a .png, .svg or .pdf file (a name without a suffix gets .png)."""
    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"-o {out}: is a folder; give a file name such as {out / 'loss.png'}")
    if out.suffix == "":
        return out.with_name(out.name + ".png")
    if out.suffix.lower() not in FORMATS:
        raise ConfigError(f"-o {out}: expected a {', '.join(FORMATS)} file, got {out.suffix!r}")
    return out


def plot_metrics(metrics: str | Path, out: str | Path) -> Path:
    """Write a PNG with the loss curve (left) and the evaluations' test accuracy (right; the
    test loss for a run without accuracy, a regression or a language model)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = output_path(out)
    records = read_metrics(metrics)
    offset = step_offset(records)  # older files number step records from 0
    steps = [(x + offset, y) for x, y in _points(metrics, records, "step", "step", "loss")]
    # the evaluations by update (every epoch, or --eval-every N); files without eval records: the epochs'
    epochs, xlabel = _points(metrics, records, "eval", "step", "accuracy"), "update"
    shown = "test accuracy"
    if not epochs:
        epochs, shown = _points(metrics, records, "eval", "step", "loss"), "test loss"
    if not epochs:
        xlabel, shown = "epoch", "test accuracy"
        epochs = [(e + 1, a) for e, a in _points(metrics, records, "epoch", "epoch", "test_accuracy")]
    if not epochs:
        epochs, shown = [(e + 1, v) for e, v in _points(metrics, records, "epoch", "epoch", "test_loss")], "test loss"
    if not steps and not epochs:
        raise ConfigError(f"{metrics}: no step, evaluation or epoch records to plot")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    if steps:
        ax1.plot(*zip(*steps), color="tab:blue", linewidth=1.2)
    ax1.set_xlabel("update")
    ax1.set_ylabel("training loss (pre-update)")
    ax1.set_yscale("log")
    ax1.grid(alpha=0.3)
    if epochs:
        ax2.plot(*zip(*epochs), marker="o", color="tab:green")
    ax2.set_xlabel(xlabel)
    ax2.set_ylabel(shown)
    ax2.grid(alpha=0.3)
    fig.suptitle("leantrain run")
    fig.tight_layout()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
    except OSError as e:
        raise ConfigError(f"-o {out}: cannot be written ({e.strerror or e})") from None
    finally:
        plt.close(fig)
    return out
