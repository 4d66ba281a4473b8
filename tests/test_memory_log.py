"""``log_memory=True``: each logged update's metrics carry the peak memory since the last
log line (resident set on CPU), in every logger (#54 item 10)."""

from __future__ import annotations

import json

import torch

import leantrain as lt
from leantrain import optim


def test_logged_updates_carry_the_windows_peak_memory(tmp_path):
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(8)]
    runner = lt.Runner.from_module(torch.nn.Linear(3, 1), "mse")
    events = []
    cfg = lt.LoaderTrainConfig(epochs=1, optimizer=optim.sgd(0.1), log_every=2, log_memory=True)
    lt.train_loader(runner, cfg, lt.DataLoader(data, batch_size=2), log=None,
                    callbacks=[lt.JSONLLogger(tmp_path / "m.jsonl")], callback=lambda e: events.append(e) and False)
    peaks = [e.throughput["peak_memory_mib"] for e in events if e.loss is not None]
    assert len(peaks) == 2 and all(10 < p < 64 * 1024 for p in peaks)  # MiB: a Python process with torch
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["peak_memory_mib"] for r in records if "peak_memory_mib" in r] == peaks
    off = []
    lt.train_loader(runner, lt.LoaderTrainConfig(epochs=1, optimizer=optim.sgd(0.1), log_every=2),
                    lt.DataLoader(data, batch_size=2), log=None, callback=lambda e: off.append(e) and False)
    assert all("peak_memory_mib" not in (e.throughput or {}) for e in off)
