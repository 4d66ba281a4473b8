"""Memory watching for the in-memory loop (spec §7.5).

Cadence: ``mem_watch`` when nonzero; otherwise ``max(1, steps // 10)`` on CUDA for
runs of at least 1000 steps; otherwise off. A sample prints the allocator state
(CUDA) or the process's resident memory (CPU) at step 0 and every ``cadence``
steps, and warns once when the drop per step projects exhaustion before the end.
"""

from __future__ import annotations

from typing import Callable, Optional

import psutil
import torch


def cadence(mem_watch: int, steps: int, device: torch.device) -> int:
    if mem_watch:
        return mem_watch
    if device.type == "cuda" and steps >= 1000:
        return max(1, steps // 10)
    return 0


def _cpu_rss_and_free() -> tuple[int, int]:
    """(resident bytes of this process, available bytes of the machine): psutil's, on every
    system; "available" is the kernel's estimate of what can be allocated without swapping
    (free memory plus the page cache it can drop), not free memory alone."""
    return psutil.Process().memory_info().rss, psutil.virtual_memory().available


class MemoryWatch:
    """Callable ``watch(done_steps)``; does nothing when the cadence is 0."""

    def __init__(
        self, every: int, total_steps: int, device: torch.device, log: Callable[[str], None] = print
    ) -> None:
        self.every, self.total, self.device, self.log = every, total_steps, device, log
        self.first: Optional[tuple[int, int]] = None
        self.warned = False
        self.samples: list[tuple[int, int]] = []

    def _read(self) -> tuple[str, int]:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            alloc = torch.cuda.memory_allocated(self.device)
            reserved = torch.cuda.memory_reserved(self.device)
            mib = 2**20
            return (
                f"cuda_mem allocated={alloc // mib}MiB reserved={reserved // mib}MiB "
                f"free={free // mib}MiB total={total // mib}MiB",
                free,
            )
        rss, free = _cpu_rss_and_free()
        return f"mem rss={rss // 2**20}MiB available={free // 2**20}MiB", free

    def __call__(self, done: int) -> None:
        if self.every <= 0 or (done != 0 and done % self.every != 0):
            return
        text, free = self._read()
        self.samples.append((done, free))
        self.log(f"  {text.split(' ', 1)[0]} step={done}: {text.split(' ', 1)[1]}")
        if self.first is None:
            self.first = (done, free)
            return
        first_step, first_free = self.first
        if self.warned or done <= first_step or free >= first_free:
            return
        per_step = (first_free - free) // max(1, done - first_step)
        if per_step > 0 and done + free // per_step < self.total:
            self.warned = True
            self.log(
                f"  warning: free memory fell by {per_step} bytes/step since step {first_step}; "
                f"at this rate allocation fails near step {done + free // per_step} of {self.total}"
            )


def peak_since_last(device: torch.device) -> int:
    """The peak memory in bytes since the last call (then started again): CUDA's allocator
    peak (``max_memory_allocated``), or on CPU the process's peak resident set (Linux's
    ``VmHWM``, reset through ``/proc/self/clear_refs``; elsewhere the current resident set,
    psutil's)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return int(peak)
    try:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the kernel's reset of the peak resident set
        return kib * 1024
    except (OSError, StopIteration, ValueError):
        return int(psutil.Process().memory_info().rss)
