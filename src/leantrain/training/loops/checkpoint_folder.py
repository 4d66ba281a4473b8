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
anything older is deleted. The record of kept files travels in every checkpoint's
progress (so the best so far survives a resume) with the folder it lives in and, per
file, its identity: the run's id (kept across resumes) and a random id of that very
file, both also written in the file itself. A file is deleted, or loaded as the best,
only when its own manifest shows that identity: a file of another run (a second job
in the folder, a copy, a folder reused by a resume into another place) is never
touched, and a best that is no longer this run's is an error, not a silent load.
Entries recorded before files carried an identity are kept, never deleted.
``resume_from="auto"`` resumes from the newest file of the folder that reads back whole
(a file torn by a crash is passed over, with a warning saying why).

The file name's format specs must read back: ``{step:06d}`` does, ``{step:x}``,
``{step:+}``, ``{step:4d}`` (spaces) or ``{step:,}`` do not, and are refused when the
config is built (formatting a few steps and parsing them back).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import string
import warnings
from pathlib import Path
from typing import Optional

from ...errors import CheckpointError, ConfigError
from ...io.checkfile import read_manifest
from ...io.checkpoint import read_checkpoint
from ...io.sharded import INDEX
from ...validate import is_int, is_number

FIELDS = {"step": r"\d+", "epoch": r"\d+", "metric": r"[-+.\w]+"}


def file_id_of(nonce: str, k: int) -> str:
    """The id of the ``k``-th file a run's start writes (``nonce``: that start's random seed,
    rank 0's): the same on every rank, different for every file of every run."""
    return hashlib.sha256(f"{nonce}:{k}".encode()).hexdigest()[:16]


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


def check_template(op: str, path, managed: bool) -> None:
    """A checkpoint path's name fields: none (then ``managed``, keeping a folder, is
    refused), or ``{step}`` (required), ``{epoch}`` and ``{metric}`` in the file name
    only, with format specs whose names read back."""
    fields = template_fields(path)
    if fields is None:
        if managed:
            raise ConfigError(f"{op}: keep_last, keep_best and load_best_at_end keep a folder of checkpoints: give "
                              f"checkpoint_path a name with {{step}} in it (e.g. 'runs/job/step{{step}}.ckpt')")
        return
    bad = [f for f in fields if f.split(":")[0] not in FIELDS or not f]
    if bad or "step" not in fields:
        raise ConfigError(f"{op}: checkpoint_path {str(path)!r}: its name takes {{step}} (required), "
                          f"{{epoch}} and {{metric}}, got fields {fields}")
    if "{" in str(Path(path).parent):
        raise ConfigError(f"{op}: checkpoint_path {str(path)!r}: only the file name may hold fields")
    check_readable_names(op, Path(path))


class CheckpointFolder:
    """The files a run keeps (see the module docstring); ``entries``: what this run and
    the runs it resumes wrote in this folder and still keep, ``[name, step, metric,
    run id, file id]`` each (``[name, step, metric]`` for files written before files
    carried an identity)."""

    def __init__(self, op: str, settings) -> None:
        self.op, self.settings = op, settings  # the run's CheckpointOptions
        self.template = Path(settings.path)
        self.folder = self.template.parent
        self.entries: list[list] = []
        self.pattern = name_pattern(self.template)

    def where(self) -> str:
        """The folder as the record names it (absolute)."""
        return str(self.folder.resolve())

    def path_for(self, step: int, epoch: Optional[int], metric: Optional[float]) -> Path:
        value = float("nan") if metric is None else metric
        return self.folder / self.template.name.format(step=step, epoch=epoch or 0, metric=value)

    def record(self, path: Path, step: int, metric: Optional[float], run_id: str, file_id: str) -> list[list]:
        """The entries once ``path`` is written: what the new checkpoint's progress saves."""
        kept = [e for e in self.entries if e[0] != path.name]
        return kept + [[path.name, step, metric, run_id, file_id]]

    def written(self, path: Path, entries: list[list], main: bool = True) -> None:
        """After a save: take ``entries`` as kept and, when the rules drop some, read ``path``
        back whole before deleting those proven this run's (never ``path``, never a file
        not recorded, never one whose manifest names another run or file). Under
        ``torch.distributed`` every rank keeps the record; only rank 0 (``main``, the one
        that wrote) reads and deletes."""
        self.entries = entries
        keep = self.kept_names() | {path.name}
        going = [e for e in self.entries if e[0] not in keep]
        if main and going:
            read_checkpoint(path, self.op)  # verified before anything older goes (read only when something does)
            for entry in going:
                if self.proven(entry):
                    (self.folder / entry[0]).unlink(missing_ok=True)
        self.entries = [e for e in self.entries if e[0] in keep]

    def proven(self, entry: list) -> bool:
        """Whether the file an entry names is the one this run wrote: its manifest shows
        the entry's step, run id and file id (an entry without an identity never is)."""
        if len(entry) < 5:
            return False
        return self.identity_problem(entry) is None

    def identity_problem(self, entry: list) -> Optional[str]:
        """Why the file ``entry`` names is not the one recorded (``None``: it is)."""
        path = self.folder / entry[0]
        if path.is_symlink() or not path.is_file():
            return f"{path} is gone (or is no longer a plain file)"
        try:
            manifest = read_manifest(path, self.op)
        except CheckpointError as e:
            return f"{path} no longer reads as a checkpoint ({str(e).splitlines()[0]})"
        identity = manifest.get("identity") or {}
        found = ((manifest.get("progress") or {}).get("step"), identity.get("run"), identity.get("file"))
        if len(entry) < 5 or found != (entry[1], entry[3], entry[4]):
            return (f"{path} is not the file this run wrote there (it records update {found[0]!r} of run "
                    f"{found[1]!r}; this run wrote update {entry[1]!r} of run "
                    f"{entry[3] if len(entry) >= 5 else 'unknown'!r}): another job writes into this folder?")
        return None

    def kept_names(self) -> set[str]:
        by_step = sorted(self.entries, key=lambda e: e[1])
        keep: set[str] = set()
        if self.settings.keep_last is not None:
            keep |= {e[0] for e in by_step[-self.settings.keep_last:]}
        elif self.settings.keep_best is None:
            keep |= {e[0] for e in by_step}  # no rule: every file stays
        if self.settings.keep_best is not None:
            keep |= {e[0] for e in self.ranked()[:self.settings.keep_best]}
        return keep

    def ranked(self) -> list[list]:
        """The entries with a finite metric, best first (ties: the earlier update)."""
        sign = 1.0 if self.settings.mode == "min" else -1.0
        scored = [e for e in self.entries if e[2] is not None and math.isfinite(e[2])]
        return sorted(scored, key=lambda e: (sign * e[2], e[1]))

    def best_entry(self) -> Optional[list]:
        ranked = self.ranked()
        return ranked[0] if ranked else None

    def best(self) -> Optional[Path]:
        entry = self.best_entry()
        return None if entry is None else self.folder / entry[0]

    def best_problem(self) -> Optional[str]:
        """Why the best kept file is no longer the one this run wrote (``None``: it is, or
        there is no best, or its entry predates identities)."""
        entry = self.best_entry()
        return None if entry is None or len(entry) < 5 else self.identity_problem(entry)

    def check_best(self, why: Optional[str] = None) -> None:
        """Raise ``CheckpointError`` when the best kept file is no longer the one this run
        wrote (checked after each save while keeping the best, and before loading it;
        ``why``: the problem found where the file was written, rank 0)."""
        why = why if why is not None else self.best_problem()
        if why is not None:
            raise CheckpointError(f"{self.op}: the best checkpoint kept: {why}; it is not loaded (give each job "
                                  f"its own checkpoint folder)")

    def problems(self, entries: object) -> list[str]:
        """Why a checkpoint's record of kept files cannot be taken back (checked before a
        resume installs anything)."""
        if isinstance(entries, list) and all(
                isinstance(e, list) and len(e) in (3, 5) and isinstance(e[0], str) and self.pattern.fullmatch(e[0])
                and is_int(e[1]) and (e[2] is None or is_number(e[2]))
                and (len(e) == 3 or (isinstance(e[3], str) and isinstance(e[4], str))) for e in entries):
            return []
        shaped = isinstance(entries, list) and entries and all(  # plain file names that carry their step
            isinstance(e, list) and len(e) in (3, 5) and isinstance(e[0], str) and Path(e[0]).name == e[0]
            and e[0] not in (".", "..") and is_int(e[1]) and str(e[1]) in e[0] for e in entries)
        if shaped and not any(self.pattern.fullmatch(e[0]) for e in entries):  # the template was renamed
            return [f"the run kept its checkpoints under other names (such as {entries[-1][0]!r}) than this run's "
                    f"checkpoint_path makes ({self.template.name!r}): resume with the checkpoint_path the run "
                    f"was started with, or give this run a fresh folder (the kept files are the run's and are "
                    f"not renamed)"]
        return [f"progress.checkpoints: expected [name, step, metric, run id, file id] entries naming files of "
                f"{self.template.name!r}"]

    def resume(self, entries: list, folder: Optional[str]) -> None:
        """Take back the entries a checkpoint's progress saved (checked by ``problems``),
        if they are this folder's: a run resumed into another folder keeps (and may
        delete) nothing it recorded elsewhere."""
        same = folder is None or folder == self.where()
        self.entries = [list(e) for e in entries] if same else []

    def newest_valid(self) -> Optional[Path]:
        """The newest checkpoint of the folder that reads back whole (``None``: none)."""
        return newest_whole(self.template, self.op)


SAMPLE_STEPS = (0, 1, 7, 12, 99, 1000, 123456, 2**31)
SAMPLE_METRICS = (0.0, -1.5, 0.123456789, 1e-12, 3e10, float("nan"), float("inf"))


def check_readable_names(op: str, template: Path) -> None:
    """Refuse a template whose names the folder cannot read back: every field formats, the
    name it makes matches the template's pattern, and the step parsed back is the step
    written (checked on a few steps, epochs and metrics)."""
    pattern = name_pattern(template)
    for k, step in enumerate(SAMPLE_STEPS):
        metric, epoch = SAMPLE_METRICS[k % len(SAMPLE_METRICS)], (step * 7) % 1001
        try:
            name = template.name.format(step=step, epoch=epoch, metric=metric)
        except (ValueError, TypeError, KeyError, IndexError) as e:
            raise ConfigError(f"{op}: checkpoint_path {str(template)!r}: its name does not format ({e}); use "
                              f"{{step}} or {{step:06d}}") from None
        m = pattern.fullmatch(name)
        if m is None or int(m.group("step")) != step:
            raise ConfigError(
                f"{op}: checkpoint_path {str(template)!r}: the name {name!r} (update {step}) does not read back as "
                f"update {step}, so resume_from='auto' and the kept files could not find it; give {{step}} as "
                f"plain digits: {{step}} or zero-padded {{step:06d}}")


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


def resume_path(settings, folder: Optional[CheckpointFolder] = None):
    """The checkpoint a run with ``settings`` (its ``CheckpointOptions``) resumes from:
    ``resume_from``, or with ``"auto"`` the checkpoint at ``path`` when one exists, the
    newest whole one of a folder of checkpoints (``None``: start fresh)."""
    if settings.resume_from != "auto":
        return settings.resume_from
    if folder is not None:
        return folder.newest_valid()
    path = Path(settings.path)
    return path if path.is_file() or (path / INDEX).is_file() else None  # a folder: once its index exists
