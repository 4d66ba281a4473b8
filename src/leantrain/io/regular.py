"""Reading a file that must be a regular file: never blocking on a FIFO, never reading a
device, the OS's refusal as a ``CheckpointError`` (what the command and TorchLean's
formats read a user's file with)."""

from __future__ import annotations

import json
import os
import stat

from ..errors import CheckpointError
from .atomic import PathLike


def open_regular(op: str, path: PathLike) -> int:
    """A read-only descriptor of ``path``, refused unless it is a regular file: opening
    does not block (a FIFO would wait for a writer forever), and a FIFO, socket or
    device is a ``CheckpointError`` before anything is read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            what = "a folder" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, socket or device)"
            raise CheckpointError(f"{op}: {path}: is {what}")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(op: str, path: PathLike, limit: int = -1) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``; see ``open_regular``)."""
    try:
        with os.fdopen(open_regular(op, path), "rb") as f:
            return f.read(limit)
    except OSError as e:
        raise CheckpointError(f"{op}: {path}: cannot be read ({e.strerror or e})") from None


def read_json(op: str, path: PathLike) -> object:
    data = read_regular(op, path)
    try:
        return json.loads(data.decode())
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{op}: not a readable JSON file ({type(e).__name__}: {e})") from None
