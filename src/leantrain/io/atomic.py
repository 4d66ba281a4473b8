"""Atomic file replacement: write a temporary beside the target, flush, fsync, rename,
fsync the folder.

A failure at any point leaves the previous file intact; the temporary is removed.
The temporary lives in its own hidden folder ``.{name}.tmp-{pid}-{nanos}/`` (so files
a writer library makes on the side land there too); a later successful write
recognises the folders a killed writer left behind and removes them.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Callable, Union

PathLike = Union[str, os.PathLike]


def temp_prefix(path: Path) -> str:
    return f".{path.name}.tmp-"


def atomic_write(path: PathLike, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` to produce the new file, then move it over ``path``."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    folder.mkdir(parents=True, exist_ok=True)
    scratch = folder / f"{temp_prefix(path)}{os.getpid()}-{time.monotonic_ns()}"
    scratch.mkdir()
    tmp = scratch / path.name
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    _fsync_dir(folder)
    remove_stale_temporaries(path)
    return path


def atomic_write_bytes(path: PathLike, data: bytes) -> Path:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()

    return atomic_write(path, write)


def remove_stale_temporaries(path: Path) -> list[Path]:
    """Delete temporaries of ``path`` left by writers that died (not the live ones of
    other processes of ours: only those whose pid is gone)."""
    removed = []
    prefix = temp_prefix(path)
    for tmp in path.parent.glob(prefix + "*"):
        pid = tmp.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
            continue
        if pid.isdigit() and int(pid) == os.getpid():
            continue  # one of ours in flight (another thread): leave it
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
