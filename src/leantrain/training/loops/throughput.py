"""Throughput at the log cadence: samples/s, tokens/s and a model FLOPs utilisation.

Samples are examples: an in-memory loop's items; a loader's collated batch counts its
leading size (the loop adds it as it reads the batch: a host shape, no read). Each
update adds, for token data, its token count:
an ``attention_mask``'s sum where the inputs have one, else the ``input_ids``' size. A
mask on the host is summed there (no device read); one already on the accelerator is
summed there into a device counter, read only when a log line is due, next to the loss
(the same synchronization point). The rates cover the updates since the previous log
line, timed on the host between two log points, which both wait for the device, so the
window holds the device's work, not just the launches.

MFU (model FLOPs utilisation) is ``6 * N * tokens/s / peak``: ``N`` trainable values (a
tied weight once), 6 FLOPs per value per token (the forward's 2 and the backward's 4,
the usual estimate for a dense model; attention's own FLOPs left out), ``peak`` the
``peak_flops`` the config gives, else the dense bf16/fp16 tensor-core peak of a known
accelerator (the vendor's figure, the one MFU is usually quoted against; ``None`` on the
CPU or an unknown device: no MFU).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Optional

import torch

from ..runner.runner import Runner

TIMING_FIELDS = ("samples_per_s", "tokens_per_s", "mfu")  # what a logged update's throughput holds

# Dense (no sparsity) bf16/fp16 tensor-core peaks in FLOP/s, from the vendors' data sheets;
# the first name found in torch.cuda.get_device_name() wins (so "H100 PCIe" before "H100").
PEAK_FLOPS = (
    ("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("B200", 2250e12), ("A100", 312e12),
    ("L40S", 362e12), ("L4", 121e12), ("A10G", 125e12), ("A10", 125e12), ("V100", 125e12), ("T4", 65e12),
    ("RTX 4090", 165e12), ("RTX 3090", 71e12),
)


def device_peak(device: torch.device) -> Optional[float]:
    """The table's peak for ``device`` (``None``: not an accelerator the table knows)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_FLOPS if key in name), None)


def _inputs(sample: Any) -> Any:
    return sample[0] if isinstance(sample, tuple) else sample


def token_counter(sample: Any) -> Optional[Callable[[Any], Any]]:
    """How to count a sample's tokens, decided from the first sample (``None``: not
    token data): a dict of inputs with an ``attention_mask`` or ``input_ids``."""
    x = _inputs(sample)
    if not isinstance(x, dict):
        return None
    if isinstance(x.get("attention_mask"), torch.Tensor):
        return lambda s: _inputs(s)["attention_mask"].sum()
    if isinstance(x.get("input_ids"), torch.Tensor):
        return lambda s: _inputs(s)["input_ids"].numel()
    return None


class Throughput:
    """Counts between log points; ``read()`` gives the window's rates and starts the next."""

    def __init__(self, runner: Runner, peak_flops: Optional[float], memory: bool = False) -> None:
        self.memory, self.device = memory, runner.device
        self.items, self.tokens = 0, 0
        self.examples = 0  # a loader loop counts its batches' examples here; else each item is one
        self.device_tokens: Optional[torch.Tensor] = None
        self.seen, self.device_seen = 0, None  # the run's tokens (host, and a device sum read once, at the end)
        self.counter: Optional[Callable] = None
        self.decided = False
        self.since = time.perf_counter()
        reps = runner.params.canonical_slot_indices()
        self.n = sum(math.prod(v.shape) for i, (v, c) in enumerate(zip(runner.params, reps)) if c == i)
        self.peak = peak_flops if peak_flops is not None else device_peak(runner.device)

    def saw(self, examples: int) -> None:
        """A loader batch's examples (its collated rows), as the loop reads it."""
        self.examples += examples

    def count(self, batch: list) -> None:
        """One update's items (and tokens): host arithmetic, or a device sum kept there."""
        self.items += len(batch)
        if not self.decided:
            self.counter, self.decided = token_counter(batch[0]) if batch else None, True
        if self.counter is None:
            return
        for s in batch:
            k = self.counter(s)
            if isinstance(k, torch.Tensor) and k.device.type != "cpu":
                self.device_tokens = k.to(torch.int64) if self.device_tokens is None else self.device_tokens + k
                self.device_seen = k.to(torch.int64) if self.device_seen is None else self.device_seen + k
            else:
                self.tokens += int(k)  # a host tensor or a number: no device read
                self.seen += int(k)

    def tokens_seen(self) -> Optional[int]:
        """The tokens of every update this run made (``None``: not token data); reads the
        device's count back once (the run's end)."""
        if self.counter is None:
            return None
        return self.seen + (0 if self.device_seen is None else int(self.device_seen.item()))  # intentional, at the end

    def read(self) -> dict:
        """The rates since the last read (a log line is due: the device already waited)."""
        now = time.perf_counter()
        elapsed, self.since = max(now - self.since, 1e-9), now
        out = {"samples_per_s": (self.examples or self.items) / elapsed}
        if self.counter is not None:
            tokens = self.tokens
            if self.device_tokens is not None:
                tokens += int(self.device_tokens.item())  # intentional sync: a log line is due
            out["tokens_per_s"] = tokens / elapsed
            if self.peak is not None:
                out["mfu"] = 6.0 * self.n * out["tokens_per_s"] / self.peak
        if self.memory:  # the window's peak (Lightning's DeviceStatsMonitor)
            from .memory import peak_since_last

            out["peak_memory_mib"] = peak_since_last(self.device) / 2**20
        self.items, self.tokens, self.examples, self.device_tokens = 0, 0, 0, None
        return out

    def start(self) -> None:
        """The first window starts with the first update, not with the run's set-up."""
        self.since = time.perf_counter()
        if self.memory:
            from .memory import peak_since_last

            peak_since_last(self.device)  # the set-up's peak is not the first window's
