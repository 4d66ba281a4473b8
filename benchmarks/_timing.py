"""Shared timing helpers: interleaved runs, median of per-run ratios."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def interleaved_ratio(
    ours: Callable[[], None], theirs: Callable[[], None], runs: int = 15, reps: int = 5, warmup: int = 3
) -> tuple[float, float, float]:
    """(median ratio ours/theirs, median seconds per call ours, theirs)."""
    for _ in range(warmup):
        ours()
        theirs()
    ratios, t_ours, t_theirs = [], [], []
    for r in range(runs):
        pair = [(ours, t_ours), (theirs, t_theirs)]
        if r % 2:
            pair.reverse()  # alternate who goes first
        times = {}
        for fn, acc in pair:
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            dt = (time.perf_counter() - start) / reps
            acc.append(dt)
            times[id(acc)] = dt
        ratios.append(times[id(t_ours)] / times[id(t_theirs)])
    return statistics.median(ratios), statistics.median(t_ours), statistics.median(t_theirs)


def interleaved_ratios(
    ours: Callable[[], None], theirs: Callable[[], None], runs: int = 11, reps: int = 1, warmup: int = 2
) -> tuple[float, float, float, float]:
    """(median ratio, best-of-N ratio, median seconds ours, theirs). The best of N is
    each side's fastest run, ``min(ours) / min(theirs)``: the figure least disturbed by a
    shared, noisy machine (not the smallest per-run ratio, which picks the luckiest pair);
    the median of the per-run ratios shows the spread."""
    for _ in range(warmup):
        ours()
        theirs()
    ratios, t_ours, t_theirs = [], [], []
    for r in range(runs):
        order = [(ours, t_ours), (theirs, t_theirs)]
        if r % 2:
            order.reverse()
        for fn, acc in order:
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            acc.append((time.perf_counter() - start) / reps)
        ratios.append(t_ours[-1] / t_theirs[-1])
    return statistics.median(ratios), min(t_ours) / min(t_theirs), statistics.median(t_ours), statistics.median(t_theirs)
