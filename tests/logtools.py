"""Reading metrics files in tests: the records with the wall-clock throughput fields taken
out (they measure this run's speed, so two runs never agree on them; every other field of
a resumed run's log must equal the straight run's)."""

import json

from leantrain.training.loops.throughput import TIMING_FIELDS


def records_without_timing(path) -> list[dict]:
    """Each JSONL record of ``path``, in order, without the throughput fields (a line
    that is not a JSON record is kept as its text, so a torn line still compares)."""
    out = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            record = json.loads(line)
        except ValueError:
            out.append(line)
            continue
        out.append({k: v for k, v in record.items() if k not in TIMING_FIELDS} if isinstance(record, dict) else record)
    return out
