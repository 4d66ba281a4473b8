"""What ``leantrain train`` adds to a run from its run-management flags: where the
checkpoints go (one file, or with ``--keep-last``/``--keep-best`` a folder of them), the
trackers of ``--log-to``, the metric ``--keep-best`` watches, ``--profile``'s updates.

A run folder holds ``checkpoint.ckpt`` (one file, replaced at each save), or, with
``--keep-last K`` or ``--keep-best METRIC``, ``checkpoints/step{N}.ckpt`` (the last K and
the best, pruned as the run goes); ``--resume`` continues from the newest whole one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from ..training.loops.callbacks import Callback
from ..training.loops.loggers import CSVLogger, MLflowLogger, TensorBoardLogger, WandbLogger
from ..training.loops.checkpoint_folder import newest_whole
from .usage import UserError

TRACKERS = ("tensorboard", "csv", "wandb", "mlflow")
FOLDER = "checkpoints"
TEMPLATE = "step{step}.ckpt"
LOWER_IS_BETTER = ("loss", "perplexity", "error")


def managed(cfg) -> bool:
    """Whether the run keeps a folder of checkpoints."""
    return cfg.keep_last is not None or cfg.keep_best is not None


def checkpoint_path(out: Path, cfg) -> Path:
    """The run's checkpoint: the file, or the folder's name template."""
    return out / FOLDER / TEMPLATE if managed(cfg) else out / "checkpoint.ckpt"


def resumable(out: Path) -> Optional[Path]:
    """The checkpoint a resume of the run in ``out`` starts from (``None``: none): its file,
    or the newest whole file of its folder of checkpoints."""
    single = out / "checkpoint.ckpt"
    if single.is_file() or (single / "index.json").is_file():
        return single
    return newest_whole(out / FOLDER / TEMPLATE, "--resume")


def run_checkpoint(src: Path, step: Optional[int] = None) -> Path:
    """The checkpoint a command reads from ``src``: a checkpoint file or sharded folder as
    given, or a run folder's: its ``checkpoint.ckpt``, or of a run keeping a folder of
    checkpoints ``step{step}.ckpt``, the best (``--keep-best``: ranked by the newest
    whole file's record, with the run's direction) or else the newest whole file. The
    run's ``config.json`` is read as data only."""
    from ..io.sharded import INDEX

    run = src.is_dir() and not (src / INDEX).exists() and ((src / "checkpoint.ckpt").exists() or (src / FOLDER).is_dir())
    if not run:
        if step is not None:
            raise UserError(f"export: --step picks a kept checkpoint of a run folder; {src} is not one")
        return src
    if (src / "checkpoint.ckpt").exists():
        if step is not None:
            raise UserError(f"export: --step picks a kept checkpoint; the run in {src} keeps one checkpoint "
                            f"(checkpoint.ckpt): drop --step")
        return src / "checkpoint.ckpt"
    if step is not None:
        chosen = src / FOLDER / TEMPLATE.format(step=step)
        if not chosen.is_file():
            kept = sorted(p.name for p in (src / FOLDER).glob("step*.ckpt"))
            raise UserError(f"export: --step {step}: {chosen} is not kept (the run keeps {', '.join(kept) or 'none'})")
        return chosen
    newest = newest_whole(src / FOLDER / TEMPLATE, "export")
    if newest is None:
        raise UserError(f"export: {src / FOLDER} holds no whole checkpoint")
    return best_kept(src, newest) or newest


def best_kept(src: Path, newest: Path) -> Optional[Path]:
    """The best checkpoint a ``--keep-best`` run in ``src`` keeps, ranked by ``newest``'s
    record with the run's direction (``None``: the run keeps no best, or none ranks)."""
    import json

    from ..io.checkpoint import read_checkpoint

    try:
        settings = json.loads((src / "config.json").read_text())
    except (OSError, ValueError, RecursionError):
        settings = {}
    best = settings.get("keep_best") if isinstance(settings, dict) else None
    if not isinstance(best, str) or check_keep_best(best) is not None:
        return None
    _, mode = keep_best(best)
    sign = 1.0 if mode == "min" else -1.0
    entries = read_checkpoint(newest, "export")[0]["progress"].get("checkpoints", [])
    scored = [e for e in entries if e[2] is not None and e[2] == e[2] and abs(e[2]) != float("inf")
              and (src / FOLDER / e[0]).is_file()]
    return src / FOLDER / min(scored, key=lambda e: (sign * e[2], e[1]))[0] if scored else None


def kept_folder(path: Path) -> Optional[Path]:
    """The folder of kept checkpoints ``path`` names: a run folder's ``checkpoints/`` (a run
    with ``--keep-last``/``--keep-best``), or such a folder itself (``None``: neither)."""
    from ..io.sharded import INDEX

    if not path.is_dir() or (path / INDEX).exists() or (path / "checkpoint.ckpt").exists():
        return None
    if (path / FOLDER).is_dir():
        return path / FOLDER
    return path if any(p.is_file() for p in path.glob("step*.ckpt")) else None


def describe_kept(path: Path, folder: Path) -> Path:
    """Print what a folder of kept checkpoints holds (each file's update and metric as the
    newest whole file records them, the newest, the best) and return the one to show in
    detail: the best of a ``--keep-best`` run, else the newest whole one."""
    from ..io.checkpoint import read_checkpoint

    newest = newest_whole(folder / TEMPLATE, "inspect")
    if newest is None:
        raise UserError(f"inspect: {folder} holds no whole checkpoint (no file step<N>.ckpt reads back whole)")
    best = best_kept(path, newest) if folder == path / FOLDER else None
    chosen = best or newest
    entries = {e[0]: e for e in read_checkpoint(newest, "inspect")[0]["progress"].get("checkpoints", [])
               if isinstance(e, list) and len(e) >= 3}
    files = sorted((p for p in folder.glob("step*.ckpt") if p.is_file()),
                   key=lambda p: int(p.stem[4:]) if p.stem[4:].isdigit() else -1)
    what = f"a run folder keeping {len(files)} checkpoint(s) in {folder}" if folder != path else \
        f"a folder of {len(files)} kept checkpoint(s)"
    print(f"{path}: {what}")
    for p in files:
        e = entries.get(p.name)
        metric = "" if e is None or e[2] is None else f", monitored value {e[2]:.6g}"
        marks = [m for m, hit in (("the newest", p == newest), ("the best", p == best)) if hit]
        known = "in the newest file's record" if e is not None else "not in the newest file's record"
        print(f"  {p.name}: {known}{metric}" + (f" ({', '.join(marks)})" if marks else ""))
    print(f"showing {chosen.name}, {'the best' if chosen == best else 'the newest whole one'}:")
    return chosen


def best_spec(value) -> Optional[tuple[str, str, int]]:
    """``--keep-best [METRIC][:min|max][:K]`` (or a bare ``K``, by the test loss) read as
    ``(metric, direction, K)``; ``None`` when it does not read. The metric as the
    evaluation names it (``test_`` as the metrics file names it, or not), the direction by
    default lower-is-better for losses, perplexity and errors, higher for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value:
        return None
    parts = value.split(":")
    count = 1
    if parts[-1].isdigit():
        count = int(parts.pop())
        if count < 1:
            return None
        if not parts:
            parts = ["loss"]
    if not parts or len(parts) > 2 or not parts[0] or parts[0].isdigit():
        return None
    name, mode = parts[0].removeprefix("test_"), (parts[1] if len(parts) == 2 else "")
    if mode not in ("", "min", "max"):
        return None
    return name, mode or ("min" if name.endswith(LOWER_IS_BETTER) else "max"), count


def keep_best(value) -> tuple[Optional[str], str]:
    """``--keep-best``'s metric and direction (``None, "min"`` without the flag)."""
    if value is None:
        return None, "min"
    spec = best_spec(value)
    if spec is None:
        raise UserError(f"--keep-best {value}: {KEEP_BEST_RULE}")
    return spec[0], spec[1]


KEEP_BEST_RULE = ("expected a metric of the evaluation (loss, accuracy), optionally :min or :max, optionally :K "
                  "(keep the best K; a bare K keeps the best K by the loss)")


def check_keep_best(value) -> Optional[str]:
    """The rule ``--keep-best`` breaks (``None``: fine)."""
    return None if value is None or best_spec(value) is not None else KEEP_BEST_RULE


def profile_range(value: Optional[str]) -> Optional[tuple[int, int]]:
    """``--profile A:B``: updates A to B, counted from 1."""
    if value is None:
        return None
    first, _, last = value.partition(":")
    try:
        a, b = int(first), int(last or first)
    except ValueError:
        raise UserError(f"--profile {value}: expected FIRST:LAST updates (e.g. 5:8)") from None
    if not 1 <= a <= b:
        raise UserError(f"--profile {value}: expected 1 <= FIRST <= LAST")
    return a, b


def check_profile(value: Optional[str]) -> Optional[str]:
    if value is not None and not isinstance(value, str):
        return "expected FIRST:LAST updates (e.g. 5:8)"
    try:
        profile_range(value)
    except UserError as e:
        return str(e).split(": ", 1)[1]
    return None


def check_log_to(value: Optional[str]) -> Optional[str]:
    if value is None:
        return None
    if not isinstance(value, str):
        return f"expected a comma-separated list of {', '.join(TRACKERS)}"
    names = [n.strip() for n in str(value).split(",")]
    bad = [n for n in names if n not in TRACKERS]
    return f"expected a comma-separated list of {', '.join(TRACKERS)}" if bad or not names else None


def trackers(out: Path, log_to: Optional[str], main: bool) -> list[Callback]:
    """The loggers ``--log-to`` names, writing into the run folder (rank 0 only): TensorBoard
    in ``tb/``, ``metrics.csv``, W&B's files in ``wandb/`` (its mode from ``WANDB_MODE``),
    MLflow at ``MLFLOW_TRACKING_URI`` (MLflow's default when unset)."""
    if not log_to or not main:
        return []
    out_cbs: list[Callback] = []
    for name in dict.fromkeys(n.strip() for n in log_to.split(",")):
        if name == "tensorboard":
            out_cbs.append(TensorBoardLogger(out / "tb"))
        elif name == "csv":
            out_cbs.append(CSVLogger(out / "metrics.csv", epoch_results="test_"))
        elif name == "wandb":
            out_cbs.append(WandbLogger(os.environ.get("WANDB_PROJECT", "leantrain"), name=out.name, dir=out))
        else:
            out_cbs.append(MLflowLogger(os.environ.get("MLFLOW_TRACKING_URI"), experiment="leantrain",
                                        run_name=out.name))
    return out_cbs
