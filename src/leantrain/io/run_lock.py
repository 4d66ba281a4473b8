"""One run writes a checkpoint destination at a time: a lock file beside it.

A run that saves checkpoints takes the lock of where they go when it starts, before it
reads or writes anything there, and gives it back when it ends (well or not): a folder
of kept checkpoints has ``.leantrain-run.json`` inside it, a single checkpoint file
``path`` (or a sharded checkpoint folder) has ``.NAME.leantrain-run.json`` beside it.
The lock names the run (its id, kept across resumes), the process and the machine.

A second run that finds the lock refuses to start, naming both runs, while the holder
may still be running: its process is alive on this machine, or it runs on another
machine (no way to tell; remove the lock by hand once it is gone, as the message
says). A lock left by a process that died on this machine (a zombie counts as dead) is
taken over, and so is one of the same run held on another machine (a restart of that
run), and one naming this process's pid that no run of this process holds (a job
restarted in place, as a container restart gives the same pid). A file destination also
respects the lock of the folder it is in. Taking the lock is one exclusive create; a
takeover first moves the dead lock aside with one ``rename`` (of two runs taking it over
at once, one wins) and puts back what it moved if that was not the dead lock.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Optional

from .atomic import atomic_write_bytes, process_alive

NAME = ".leantrain-run.json"
_HELD: set = set()  # the lock files runs of this process hold now (a restarted job has none)


def lock_path(destination: Path, folder: bool) -> Path:
    """The lock of a checkpoint destination: inside a folder of kept checkpoints
    (``folder``), else beside the file (or sharded folder)."""
    return destination / NAME if folder else destination.parent / f".{destination.name}{NAME}"


class RunLock:
    """The lock at ``path`` for run ``run_id`` (this process)."""

    def __init__(self, path: Path, run_id: str) -> None:
        self.path, self.run_id = Path(path), run_id
        self.mine = {"run": run_id, "pid": os.getpid(), "host": socket.gethostname(),
                     "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        self.held = False

    def acquire(self, op: str, what: str) -> Optional[str]:
        """Take the lock; or the reason it cannot be taken (another run writes ``what``),
        with nothing changed. A file destination also respects the lock of the folder it
        is in (a run keeping its checkpoints there). A dead holder's lock is taken over by
        moving it aside first (one ``rename``: of two runs taking it over at once, one)."""
        data = json.dumps(self.mine).encode()
        folder_lock = self.path.parent / NAME
        if self.path != folder_lock and folder_lock.exists():  # a file in a folder a run keeps
            holder = RunLock(folder_lock, self.run_id).live_holder()
            if holder is not None and holder.get("run") != self.run_id:
                return self._refusal(op, what, holder, folder_lock)
        for _ in range(3):  # a takeover lost to another run: read the lock again
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                raw = self._raw()
                holder = self.holder()
                if holder is not None and self._live(holder):
                    return self._refusal(op, what, holder, self.path)
                self._set_aside(raw)  # a dead holder's lock (a killed run, a restart of this one)
                continue
            except OSError as e:
                return f"{op}: cannot take the lock {self.path} of {what}: {e.strerror or e}"
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            self.held = True
            _HELD.add(str(self.path))
            return None
        return f"{op}: cannot take the lock {self.path} of {what}: other runs keep taking it over"

    def _refusal(self, op: str, what: str, holder: dict, path: Path) -> str:
        mine = holder.get("run") == self.run_id
        who = ("this run (its id " + self.run_id + ") is already running from another process" if mine else
               f"another run writes the checkpoints of {what}: run {holder.get('run')!s:.40}")
        return (f"{op}: {who} (process {holder.get('pid')} on {holder.get('host')!s:.60}, started "
                f"{holder.get('started')!s:.20}); this run is {self.run_id}. Give this run its own checkpoint_path, "
                f"or wait for that run to end (if it is gone, remove {path})")

    def _raw(self) -> Optional[bytes]:
        try:
            return self.path.read_bytes()
        except OSError:
            return None

    def _set_aside(self, raw: Optional[bytes]) -> None:
        """Move a dead holder's lock (read as ``raw``) out of the way; if what was moved is
        not that lock (another run took it over meanwhile), put it back."""
        aside = self.path.with_name(f"{self.path.name}.{os.getpid()}.stale")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another run moved it first
        try:
            moved = aside.read_bytes()
        except OSError:
            moved = raw
        if raw is not None and moved != raw:  # (a torn lock read as None stays set aside)
            try:
                os.link(aside, self.path)  # back, unless a lock is there again
            except OSError:
                pass
        aside.unlink(missing_ok=True)

    def holder(self) -> Optional[dict]:
        """What the lock file names (``None``: unreadable, e.g. torn)."""
        try:
            found = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return found if isinstance(found, dict) else None

    def live_holder(self) -> Optional[dict]:
        """The run the lock names when it may still be writing (``None``: no lock, a torn
        one, or a dead holder's, which a new run may take over)."""
        holder = self.holder() if self.path.exists() else None
        return holder if holder is not None and self._live(holder) else None

    def _live(self, holder: dict) -> bool:
        """Whether the run ``holder`` names may still be writing."""
        pid = holder.get("pid")
        if holder.get("host") != self.mine["host"]:
            return holder.get("run") != self.run_id  # another machine: alive unless it is this run restarting
        if pid == os.getpid():  # a run of this very process (started from a callback), or a restarted
            return str(self.path) in _HELD  # job's dead incarnation, which had this pid too
        return isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 and process_alive(pid)

    def release(self) -> None:
        """Give the lock back (if the file still names this process)."""
        if self.held:
            self.held = False
            holder = self.holder()
            if holder is not None and holder.get("run") == self.run_id and holder.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
            _HELD.discard(str(self.path))
