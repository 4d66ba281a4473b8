"""Atomic file replacement: write a temporary beside the target, flush, fsync, rename,
fsync the folder.

A failure at any point leaves the previous file intact; the temporary is removed.
The temporary lives in its own hidden folder ``.leantrain-tmp-{digest}-{pid}-{nanos}/``
beside the target (``digest``: 16 hex digits of the file name's SHA-256), so files a
writer library makes on the side land there too and the name stays short whatever
the target's; a later successful write recognises, by exact name, the folders a
killed writer of the same file left behind and removes them.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable, Optional, Union

from safetensors import SafetensorError

from ..errors import CheckpointError

PathLike = Union[str, os.PathLike]


SCRATCH = re.compile(r"\.leantrain-tmp-([0-9a-f]{16})-([0-9]+)-([0-9]+)")


def scratch_key(path: Path) -> str:
    """A short, fixed-length digest of the file name: scratch names stay far below the
    255-byte limit whatever the target's name, and never contain its characters."""
    return hashlib.sha256(os.fsencode(path.name)).hexdigest()[:16]


def path_problem(path: object) -> Optional[str]:
    """Why the OS would refuse ``path`` before touching the disk (``None``: it may take it):
    a NUL byte, a name over 255 bytes, a path over 4096 bytes."""
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if not isinstance(text, str):
        return None
    if "\x00" in text:
        return "the path holds a NUL byte"
    raw = os.fsencode(text)
    if len(raw) >= 4096:
        return f"the path is {len(raw)} bytes long (the limit is 4095)"
    long = next((part for part in raw.split(b"/") if len(part) > 255), None)
    return None if long is None else f"a name in the path is {len(long)} bytes long (the limit is 255)"


def checked_path(op: str, path: PathLike) -> Path:
    """``path`` as a ``Path``, refused (``CheckpointError``) when the OS would refuse it."""
    problem = path_problem(path)
    if problem is not None:
        raise CheckpointError(f"{op}: {os.fspath(path)!r:.120}: {problem}")
    return Path(path)


def atomic_write(path: PathLike, write: Callable[[Path], None], op: str = "write") -> Path:
    """Call ``write(tmp)`` to produce the new file, then move it over ``path``. A failure
    (disk full, no permission, a missing folder) raises ``CheckpointError`` naming the
    path and the OS's reason; the previous file is intact and the scratch removed."""
    path = checked_path(op, path)
    folder = path.parent if str(path.parent) else Path(".")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        scratch = folder / f".leantrain-tmp-{scratch_key(path)}-{os.getpid()}-{time.monotonic_ns()}"
        scratch.mkdir()
    except OSError as e:
        raise _write_error(op, path, e) from e
    tmp = scratch / path.name
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except (OSError, SafetensorError) as e:
        raise _write_error(op, path, e) from e
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    _fsync_dir(folder)
    remove_stale_temporaries(path)
    return path


def _write_error(op: str, path: Path, e: BaseException) -> CheckpointError:
    reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0] if str(e) else type(e).__name__
    return CheckpointError(f"{op}: {path}: could not be written ({reason}); any earlier file there is unchanged")


def atomic_write_bytes(path: PathLike, data: bytes, op: str = "write") -> Path:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()

    return atomic_write(path, write, op)


def remove_stale_temporaries(path: Path) -> list[Path]:
    """Delete the scratch folders of ``path`` that writers which died left behind: only
    folders whose whole name is one this module makes for this file name, and whose
    process is gone (never another live writer's, never a file of the user's)."""
    return remove_dead_scratch(path.parent if str(path.parent) else Path("."), scratch_key(path))


def remove_dead_scratch(folder: Path, key: Optional[str] = None) -> list[Path]:
    """Delete the scratch folders in ``folder`` (of the file whose name digests to ``key``,
    or of any file) whose writer's process is gone."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        m = SCRATCH.fullmatch(entry.name)
        if m is None or (key is not None and m.group(1) != key) or not entry.is_dir(follow_symlinks=False):
            continue
        pid = int(m.group(2))
        if pid == os.getpid() or process_alive(pid):
            continue  # in flight (another thread of ours, or another live process)
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(Path(entry.path))
    return removed


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine (ours counts; a zombie, dead but not yet
    reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]  # after the command name, which may hold spaces
    except (OSError, IndexError):
        return True  # no /proc (not Linux): the process exists
    return state not in (b"Z", b"X")


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
