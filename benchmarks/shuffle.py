"""The loader's epoch shuffle (upstream's LCG order, ``data.lcg_permutation``) at 1M items:
the vectorised keys and NumPy's stable argsort against the per-item Python form it
replaced (keys appended one by one, ``list.sort``), the same order asserted first.

Prints best of N and median seconds per permutation for each, in one process,
interleaved.

Run: .venv/bin/python benchmarks/shuffle.py [--runs N] [--items N]
"""

from __future__ import annotations

import argparse
import statistics
import time

from leantrain.data import lcg_permutation
from leantrain.data import lcg_permutation_per_item as per_item


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--items", type=int, default=1_000_000)
    args = parser.parse_args()
    assert per_item(11, args.items) == lcg_permutation(11, args.items)
    times: dict[str, list[float]] = {"per-item Python": [], "vectorised": []}
    for run in range(args.runs):
        for name, fn in (("per-item Python", per_item), ("vectorised", lcg_permutation)):
            start = time.perf_counter()
            fn(run, args.items)
            times[name].append(time.perf_counter() - start)
    for name, ts in times.items():
        print(f"{name:16s} best {min(ts):.3f}s  median {statistics.median(ts):.3f}s  ({args.items} items)")


if __name__ == "__main__":
    main()
