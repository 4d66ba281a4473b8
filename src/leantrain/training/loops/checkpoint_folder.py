"""A folder of checkpoints kept by the loop: the last K, the best K by a metric.

A ``checkpoint_path`` whose file name holds ``{step}`` (and optionally ``{epoch}`` and
``{metric}``, with format specs: ``"runs/a/step{step:06d}-{metric:.3f}.ckpt"``) makes
each save a new file in that folder instead of replacing one. ``keep_last=K`` keeps the
K newest, ``keep_best=K`` the K best by ``monitor`` (an evaluation result's name) and
``mode`` (``"min"`` or ``"max"``; ties go to the earlier update); a file kept by either
rule stays, and so does the newest (what a resume starts from). With ``keep_best``
the loop also saves after every evaluation, so each evaluated update has its file and
its metric. ``load_best_at_end=True`` puts the best checkpoint's parameters back in the
model when the run ends (before the ``after`` loss).

Every file is written atomically, then read back whole (manifest and checksums) before
anything older is deleted; only files this run (or the run it resumes) wrote and
recorded are ever deleted, and the record travels in every checkpoint's progress, so
the best so far survives a resume. ``resume_from="auto"`` resumes from the newest file
of the folder that reads back whole (a file torn by a crash is passed over, with a
warning saying why).
"""

from __future__ import annotations

import math
import os
import re
import string
import warnings
from pathlib import Path
from typing import Optional

from ...errors import CheckpointError, ConfigError
from ...io.checkpoint import read_checkpoint
from ...io.sharded import INDEX
from .evaluation import result_names
from ...validate import check_bool, check_choice, check_count, is_int, is_number

FIELDS = {"step": r"\d+", "epoch": r"\d+", "metric": r"[-+.\w]+"}


def template_fields(path) -> Optional[list[str]]:
    """The replacement fields of ``path``'s file name (``None``: not a template)."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    try:
        parsed = list(string.Formatter().parse(Path(path).name))
    except ValueError:
        return None
    names = [f for _, f, _, _ in parsed if f is not None]
    return names or None


def check_keeping(op: str, cfg) -> None:
    """The folder options fit together (refused when the config is built)."""
    for name in ("keep_last", "keep_best"):
        if getattr(cfg, name) is not None:
            check_count(op, name, getattr(cfg, name), 1)
    check_choice(op, "mode", cfg.mode, ("min", "max"))
    check_bool(op, "load_best_at_end", cfg.load_best_at_end)
    if not isinstance(cfg.monitor, str):
        raise ConfigError(f"{op}: monitor must be an evaluation result's name, got {cfg.monitor!r}")
    fields = template_fields(cfg.checkpoint_path)
    managed = cfg.keep_last is not None or cfg.keep_best is not None or cfg.load_best_at_end
    if fields is None:
        if managed:
            raise ConfigError(f"{op}: keep_last, keep_best and load_best_at_end keep a folder of checkpoints: give "
                              f"checkpoint_path a name with {{step}} in it (e.g. 'runs/job/step{{step}}.ckpt')")
        return
    bad = [f for f in fields if f.split(":")[0] not in FIELDS or not f]
    if bad or "step" not in fields:
        raise ConfigError(f"{op}: checkpoint_path {str(cfg.checkpoint_path)!r}: its name takes {{step}} (required), "
                          f"{{epoch}} and {{metric}}, got fields {fields}")
    if "{" in str(Path(cfg.checkpoint_path).parent):
        raise ConfigError(f"{op}: checkpoint_path {str(cfg.checkpoint_path)!r}: only the file name may hold fields")
    if cfg.sharding is not None:
        raise ConfigError(f"{op}: a folder of checkpoints ({{step}} in checkpoint_path) is not kept for sharded "
                          f"runs, whose checkpoint is itself a folder: give a plain checkpoint_path")
    if (cfg.keep_best is not None or cfg.load_best_at_end) and cfg.eval_data is None:
        raise ConfigError(f"{op}: keep_best and load_best_at_end choose by an evaluation's {cfg.monitor!r}: "
                          f"set eval_data")
    if cfg.keep_best is not None and cfg.monitor not in result_names(cfg):
        raise ConfigError(f"{op}: keep_best monitors {cfg.monitor!r}, but the evaluations give "
                          f"{sorted(result_names(cfg))}")
    if cfg.load_best_at_end and cfg.keep_best is None:
        raise ConfigError(f"{op}: load_best_at_end loads the best checkpoint kept: set keep_best (e.g. 1)")


class CheckpointFolder:
    """The files a run keeps (see the module docstring); ``entries``: what this run and
    the runs it resumes wrote and still keep, ``[name, step, metric]`` each."""

    def __init__(self, op: str, cfg) -> None:
        self.op, self.cfg = op, cfg
        self.template = Path(cfg.checkpoint_path)
        self.folder = self.template.parent
        self.entries: list[list] = []
        self.pattern = name_pattern(self.template)

    def path_for(self, step: int, epoch: Optional[int], metric: Optional[float]) -> Path:
        value = float("nan") if metric is None else metric
        return self.folder / self.template.name.format(step=step, epoch=epoch or 0, metric=value)

    def record(self, path: Path, step: int, metric: Optional[float]) -> list[list]:
        """The entries once ``path`` is written: what the new checkpoint's progress saves."""
        kept = [e for e in self.entries if e[0] != path.name]
        return kept + [[path.name, step, metric]]

    def written(self, path: Path, entries: list[list], main: bool = True) -> None:
        """After a save: take ``entries`` as kept and, when the rules drop some, read ``path``
        back whole before deleting them (never ``path``, never a file not recorded). Under
        ``torch.distributed`` every rank keeps the record; only rank 0 (``main``, the one
        that wrote) reads and deletes."""
        self.entries = entries
        keep = self.kept_names() | {path.name}
        going = [name for name, _, _ in self.entries if name not in keep]
        if main and going:
            read_checkpoint(path, self.op)  # verified before anything older goes (read only when something does)
            for name in going:
                (self.folder / name).unlink(missing_ok=True)
        self.entries = [e for e in self.entries if e[0] in keep]

    def kept_names(self) -> set[str]:
        by_step = sorted(self.entries, key=lambda e: e[1])
        keep: set[str] = set()
        if self.cfg.keep_last is not None:
            keep |= {e[0] for e in by_step[-self.cfg.keep_last:]}
        elif self.cfg.keep_best is None:
            keep |= {e[0] for e in by_step}  # no rule: every file stays
        if self.cfg.keep_best is not None:
            keep |= {e[0] for e in self.ranked()[:self.cfg.keep_best]}
        return keep

    def ranked(self) -> list[list]:
        """The entries with a finite metric, best first (ties: the earlier update)."""
        sign = 1.0 if self.cfg.mode == "min" else -1.0
        scored = [e for e in self.entries if e[2] is not None and math.isfinite(e[2])]
        return sorted(scored, key=lambda e: (sign * e[2], e[1]))

    def best(self) -> Optional[Path]:
        ranked = self.ranked()
        return self.folder / ranked[0][0] if ranked else None

    def problems(self, entries: object) -> list[str]:
        """Why a checkpoint's record of kept files cannot be taken back (checked before a
        resume installs anything)."""
        if isinstance(entries, list) and all(
                isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and self.pattern.fullmatch(e[0])
                and is_int(e[1]) and (e[2] is None or is_number(e[2])) for e in entries):
            return []
        return [f"progress.checkpoints: expected [name, step, metric] entries naming files of "
                f"{self.template.name!r}"]

    def resume(self, entries: list) -> None:
        """Take back the entries a checkpoint's progress saved (checked by ``problems``)."""
        self.entries = [list(e) for e in entries]

    def newest_valid(self) -> Optional[Path]:
        """The newest checkpoint of the folder that reads back whole (``None``: none)."""
        return newest_whole(self.template, self.op)


def name_pattern(template: Path) -> re.Pattern:
    """The file names ``template``'s name makes (its ``step`` a named group)."""
    pattern, named = "", set()
    for literal, field, _, _ in string.Formatter().parse(template.name):
        pattern += re.escape(literal)
        if field is not None:
            pattern += FIELDS[field] if field in named else f"(?P<{field}>{FIELDS[field]})"
            named.add(field)
    return re.compile(pattern)


def newest_whole(template, op: str) -> Optional[Path]:
    """The newest file (by its step) of ``template``'s folder whose name the template
    makes and that reads back whole; each newer file that does not is passed over with a
    warning saying why (``None``: none)."""
    template = Path(template)
    folder, pattern = template.parent, name_pattern(template)
    if not folder.is_dir():
        return None
    found = []
    for p in folder.iterdir():
        m = pattern.fullmatch(p.name)
        if m and p.is_file() and not p.is_symlink():
            found.append((int(m.group("step")), p))
    for _, p in sorted(found, key=lambda x: x[0], reverse=True):
        try:
            read_checkpoint(p, op)
            return p
        except CheckpointError as e:
            warnings.warn(f"{op}: resume_from='auto' passes over {p} ({str(e).splitlines()[0]})", stacklevel=5)
    return None


def resume_path(cfg, folder: Optional[CheckpointFolder] = None):
    """The checkpoint a run resumes from: ``cfg.resume_from``, or with ``"auto"`` the
    checkpoint at ``cfg.checkpoint_path`` when one exists, the newest whole one of a
    folder of checkpoints (``None``: start fresh)."""
    if cfg.resume_from != "auto":
        return cfg.resume_from
    if folder is not None:
        return folder.newest_valid()
    path = Path(cfg.checkpoint_path)
    return path if path.is_file() or (path / INDEX).is_file() else None  # a folder: once its index exists
