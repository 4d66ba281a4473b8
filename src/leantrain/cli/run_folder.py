"""The run folder of ``leantrain train``: an earlier run in it is continued (``--resume``)
or replaced on request (``--overwrite``, which removes the earlier run's checkpoints and
results before the new run starts), never silently written over; a resumed run's metrics
file checked before anything is written; the folder made and a fresh run's settings
saved (the command's first writes)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..io.atomic import atomic_write_bytes
from ..io.run_lock import NAME as LOCK, RunLock, lock_path
from ..io.sharded import INDEX, SHARD
from .runconfig import RunConfig
from .usage import UserError

RUN_FILES = ("config.json", "metrics.jsonl", "checkpoint.ckpt", "checkpoints", "report.json", "loss.png")


def is_run_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a leantrain run (what ``train`` writes besides config.json)."""
    return any((folder / name).exists() for name in RUN_FILES if name != "config.json") or (folder / LOCK).exists()


def partial_start_of(out: Path, cfg: RunConfig) -> bool:
    """Whether ``out`` holds only the start of this very run (its settings, some metrics,
    no checkpoint and no report): what a job killed before its first checkpoint leaves."""
    try:
        saved = json.loads((out / "config.json").read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return saved == cfg.to_dict() and not (out / "report.json").exists()


def _refuse_an_earlier_run(out: Path, overwrite: bool) -> None:
    """A folder that holds an earlier run is continued (``--resume``) or replaced on
    request (``--overwrite``), never silently written over."""
    found = [name for name in RUN_FILES if (out / name).exists()]
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: is a file, not a folder")
    if found and not overwrite:
        raise UserError(
            f"--out {out}: holds an earlier run ({', '.join(found)}); continue it with "
            f"--resume {out}, or replace it with --overwrite"
        )


def check_metrics(path: Path) -> None:
    """A resumed run's metrics file: a line torn by a crash mid-write may end it (the
    logger drops it, and the records after the checkpoint, which are replayed); a damaged
    line before the last is refused, before anything is written."""
    if not path.exists():
        return
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--resume: {path}: cannot be read as text ({e})") from None
    for n, line in enumerate(lines[:-1], 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            rec = None
        if not isinstance(rec, dict):
            raise UserError(f"--resume: {path}: line {n} is not a JSON record (the file is damaged)")


def check_folder(plan, overwrite: bool):
    """Rank 0: refuse an earlier run (unless ``--overwrite``), nothing written; returns what
    makes the folder ready: ``--overwrite``'s removals of the earlier run's checkpoints and
    results (each checked now, so nothing of it can be resumed or read as the new run's),
    the folder, a fresh run's settings. The first writes of the command."""
    if not plan.main:
        return lambda: None
    removals = []
    if not plan.resuming:
        _refuse_an_earlier_run(plan.out, overwrite)  # before anything is written
        if overwrite:
            _refuse_a_live_run(plan.out)  # the lock first: --overwrite never removes a live run's files
            removals = [_removal(plan.out / name) for name in RUN_FILES if name != "config.json"]

    def prepare() -> None:
        for remove in removals:
            remove()
        make_folder(plan.out)
        if not plan.resuming:
            atomic_write_bytes(plan.out / "config.json", (json.dumps(plan.cfg.to_dict(), indent=2) + "\n").encode(),
                               "--out")

    return prepare


def _refuse_a_live_run(out: Path) -> None:
    """``--overwrite`` of a folder a live run still writes (its single checkpoint's or its
    kept folder's lock names a process that may be running) is refused, nothing removed."""
    for path in (lock_path(out / "checkpoint.ckpt", False), lock_path(out / "checkpoints", True)):
        if path.is_symlink():
            continue  # a link is not a lock this command wrote: _removal refuses the folder it is in
        holder = RunLock(path, run_id="").live_holder()
        if holder is not None:
            raise UserError(f"--overwrite: {out} is being written by a run that may still be running (run "
                            f"{holder.get('run')!s:.40}, process {holder.get('pid')} on {holder.get('host')!s:.60}, "
                            f"started {holder.get('started')!s:.20}); nothing was removed. Wait for it to end or "
                            f"stop it (if it is gone, remove {path})")


def _removal(path: Path):
    """How ``--overwrite`` removes an earlier run's ``path`` (a function, called once every
    removal is known to be possible): a file, a sharded checkpoint folder of an index and
    shards, a folder of kept ``stepN.ckpt`` files; a link or a folder holding anything
    else is the user's: refused, nothing removed."""
    if path.is_symlink():
        raise UserError(f"--overwrite: {path} is a link; the earlier run's files are not removed through it "
                        f"(remove or move the link first)")
    if not path.exists():
        return lambda: None
    if path.is_file():
        return path.unlink
    if path.name == "checkpoints":
        return _folder_removal(path, lambda p: bool(re.fullmatch(r"step\d+\.ckpt", p.name) or p.name == LOCK),  # a killed run's lock
                               "checkpoints")
    return _folder_removal(path, lambda p: p.name == INDEX or bool(SHARD.fullmatch(p.name)), "a checkpoint's")


def _folder_removal(folder: Path, ours, what: str):
    """The removal of ``folder`` when every entry is a regular file ``ours`` accepts; else refused."""
    others = [p.name for p in folder.iterdir() if not (p.is_file() and not p.is_symlink() and ours(p))]
    if others:
        raise UserError(f"--overwrite: {folder} holds files that are not {what} ({', '.join(others[:3])}); "
                        f"move them away first")

    def remove() -> None:
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()

    return remove


def make_folder(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create the folder ({e.strerror or e})") from None
