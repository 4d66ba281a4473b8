"""TorchLean's JSON bit-pattern documents, shared by the parameter-bits and the
trainer-state formats: writing in upstream's key order, and validating the records."""

from __future__ import annotations

import json
import math

from ...errors import CheckpointError, shape_str
from ...validate import is_int


def _pretty(value, indent: int = 0) -> str:
    """JSON with one key or record per line (2 spaces), number lists on one line."""
    pad, inner = " " * indent, " " * (indent + 2)
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(k)}: {_pretty(v, indent + 2)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}" if items else "{}"
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        items = [f"{inner}{_pretty(v, indent + 2)}" for v in value]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    return json.dumps(value, separators=(", ", ": "))


def bits_document(fmt: str, records: list[tuple[list[int], list[int]]], pretty: bool = True) -> bytes:
    """A TorchLean bits file: upstream's printer writes object keys in reverse order
    (``params`` before ``format``, ``values`` before ``shape``); the same order here."""
    doc = {"params": [{"values": vals, "shape": shape} for shape, vals in records], "format": fmt}
    text = _pretty(doc) if pretty else json.dumps(doc, separators=(",", ":"))
    return (text + "\n").encode() if pretty else text.encode()


def read_bits_records(op: str, doc: object, fmt: str, shapes: list, word_bits: int) -> list[list[int]]:
    """Validate a bits document against the expected ``shapes``: the words per slot."""
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise CheckpointError(f"{op}: format tag must be {fmt!r}")
    records = doc.get("params", [] if not shapes else None)  # an empty pack may omit it
    if not isinstance(records, list):
        raise CheckpointError(f"{op}: 'params' must be a list")
    if len(records) > len(shapes):
        raise CheckpointError(f"{op}: unexpected {len(records) - len(shapes)} trailing parameter record(s)")
    out = []
    for i, shape in enumerate(shapes):
        if i >= len(records):
            raise CheckpointError(f"{op}: missing parameter {i}/{len(shapes)}")
        rec = records[i]
        if not isinstance(rec, dict) or "shape" not in rec:
            raise CheckpointError(f"{op}: slot {i}: the record has no shape")
        got = rec["shape"]
        if not isinstance(got, list) or not all(is_int(d) and d >= 0 for d in got) or tuple(got) != shape:
            raise CheckpointError(f"{op}: slot {i}: expected shape {shape_str(shape)}, got {got!r}")
        n = math.prod(shape)
        words = rec.get("values", [] if n == 0 else None)  # a zero-size record may omit them
        if not isinstance(words, list) or len(words) != n:
            got_n = len(words) if isinstance(words, list) else words
            raise CheckpointError(f"{op}: slot {i}: expected {n} values, got {got_n!r}")
        if any(not is_int(w) or not 0 <= w < 2**word_bits for w in words):
            raise CheckpointError(f"{op}: slot {i}: every value must be a natural number below 2^{word_bits}")
        out.append(words)
    return out
