"""``profile=(first, last)``: ``torch.profiler`` over updates ``first`` to ``last``
(counted from 1), the trace written to ``profile_dir`` when the last one is done (or when
the run ends before it) as ``{host}_{pid}.updates{first}-{last}.pt.trace.json``: a Chrome
trace (``chrome://tracing``, Perfetto) that TensorBoard's profiler plugin reads too.

leantrain's phases are named ranges in it: ``leantrain.update`` (the gradients and the
optimizer step), ``leantrain.after_update`` (the callbacks, and inside it
``leantrain.evaluate`` and ``leantrain.checkpoint`` when they happen). Outside the
profiled updates nothing is recorded and the loop runs as without it.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Optional

import torch

from ...errors import ConfigError

_NONE = contextlib.nullcontext()


class UpdateProfiler:
    def __init__(self, op: str, first: int, last: int, folder, device: torch.device) -> None:
        self.op, self.first, self.last, self.folder = op, first, last, Path(folder)
        self.device = device
        self.prof: Optional[torch.profiler.profile] = None
        self.written: Optional[Path] = None

    @property
    def active(self) -> bool:
        return self.prof is not None

    def before(self, update: int) -> None:
        """Before update ``update`` (from 1): start when it is the first profiled one."""
        if update == self.first and self.prof is None and self.written is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()

    def after(self, update: int) -> None:
        """After update ``update`` and its callbacks: stop and write after the last one."""
        if self.prof is not None and update >= self.last:
            self.close()

    def range(self, name: str):
        return torch.profiler.record_function(name) if self.prof is not None else _NONE

    def close(self) -> None:
        """Stop and write the trace (the run ended inside the profiled updates)."""
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        name = f"{socket.gethostname()}_{os.getpid()}.updates{self.first}-{self.last}.pt.trace.json"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(self.folder / name))
        except OSError as e:
            raise ConfigError(f"{self.op}: profile_dir {self.folder}: the trace could not be written "
                              f"({e.strerror or e})") from None
        self.written = self.folder / name
