"""TorchLean's own module-parameter formats (spec §9.2, §9.4), byte for byte.

* The float32 stream: ASCII magic ``TLPF32B``, u64 version 2, u64 slot count, then
  per slot a u64 rank, the u64 dims, a u64 element count and the values as
  little-endian float32. Every slot is written (frozen buffers too, aliases once per
  slot). Values are rounded to float32.
* The JSON bit patterns: ``{"format": "torchlean_paramlist_bits_v1", "params":
  [{"shape": [...], "values": [...]}]}``, values being the binary64 bit patterns.

Both readers validate the whole file first (header, count, every shape and
payload length, no trailing data) and only then write the parameters. The optimizer
file ``TLADAMF`` lives in ``io/torchlean/adam.py``, the trainer-state JSON in ``io/torchlean/state.py``;
``load`` reads any of them. ``leantrain.torchlean_io`` is this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ...errors import CheckpointError, shape_str
from ...params.paramlist import params_of
from ..atomic import PathLike, atomic_write_bytes
from ..checkpoint import current_value
from ..regular import read_json, read_regular
from .adam import AdamFile, read_torchlean_adam, write_torchlean_adam
from .bits import bits_document, read_bits_records
from .framing import ByteReader, u64
from .state import STATE_FORMATS, read_torchlean_state, write_torchlean_state

__all__ = [
    "load", "Loaded", "detect_format", "write_torchlean_f32", "read_torchlean_f32", "encode_f32",
    "write_torchlean_bits", "read_torchlean_bits", "write_torchlean_adam", "read_torchlean_adam", "AdamFile",
    "write_torchlean_state", "read_torchlean_state",
]

MAGIC_F32, VERSION_F32 = b"TLPF32B", 2
BITS_FORMAT = "torchlean_paramlist_bits_v1"


def _u64(n: int) -> bytes:
    return u64(n, "torchlean")


def encode_f32(target) -> bytes:
    """The ``TLPF32B`` bytes of ``target``'s parameters (what ``write_torchlean_f32`` writes)."""
    params = params_of("encode_f32", target)
    out = [MAGIC_F32, _u64(VERSION_F32), _u64(len(params))]
    for v in params:
        t = current_value(v.storage).to(torch.float32).contiguous().reshape(-1)
        out.append(_u64(len(v.shape)))
        out.extend(_u64(d) for d in v.shape)
        out.append(_u64(t.numel()))
        out.append(t.numpy().astype("<f4").tobytes())
    return b"".join(out)


def write_torchlean_f32(path: PathLike, target) -> Path:
    """Write the float32 stream atomically."""
    return atomic_write_bytes(path, encode_f32(target), "write_torchlean_f32")


def read_torchlean_f32(path: PathLike, target) -> None:
    """Validate the float32 stream against ``target``'s slots, then host-write every slot."""
    params = params_of("read_torchlean_f32", target)
    op = f"read_torchlean_f32: {path}"
    r = ByteReader(read_regular(op, path), op)
    if r.take(len(MAGIC_F32)) != MAGIC_F32:
        raise CheckpointError(f"{op}: unsupported checkpoint family")
    version = r.u64()
    if version != VERSION_F32:
        raise CheckpointError(f"{op}: unsupported format version {version}; expected {VERSION_F32}")
    count = r.u64()
    if count != len(params):
        raise CheckpointError(f"{op}: parameter count: file has {count}, destination has {len(params)}")
    values = []
    shapes = params.schema().shapes  # the layout the stream must match
    for i, v in enumerate(params):
        shape = tuple(r.u64() for _ in range(r.u64()))
        n = r.u64()
        if shape != shapes[i]:
            raise CheckpointError(f"{op}: slot {i}: expected shape {shape_str(shapes[i])}, got {shape_str(shape)}")
        if n != v.storage.host.numel():
            raise CheckpointError(f"{op}: slot {i}: element count {n} does not match the shape")
        payload = bytearray(r.take(4 * n))
        values.append(torch.frombuffer(payload, dtype=torch.float32).reshape(shape) if n else torch.zeros(shape))
    if r.trailing():
        raise CheckpointError(f"{op}: {r.trailing()} trailing bytes after the last slot")
    for v, t in zip(params, values):  # all validated: install
        v.storage.write_host(t.to(v.dtype))


def write_torchlean_bits(path: PathLike, target, *, pretty: bool = True) -> Path:
    """Write the JSON bit-pattern file (binary64 bits of every value, row-major)."""
    params = params_of("write_torchlean_bits", target)
    records = []
    for v in params:
        t = current_value(v.storage).to(torch.float64).contiguous().reshape(-1)
        records.append((list(v.shape), [b & (2**64 - 1) for b in t.view(torch.int64).tolist()]))
    return atomic_write_bytes(path, bits_document(BITS_FORMAT, records, pretty), "write_torchlean_bits")


def read_torchlean_bits(path: PathLike, target) -> None:
    """Validate the JSON bit-pattern file against ``target``, then host-write every slot."""
    params = params_of("read_torchlean_bits", target)
    op = f"read_torchlean_bits: {path}"
    doc = read_json(op, path)
    shapes = list(params.schema().shapes)  # the layout the file must match
    words = read_bits_records(op, doc, BITS_FORMAT, shapes, 64)
    values = [
        torch.tensor([w - 2**64 if w >= 2**63 else w for w in ws], dtype=torch.int64)
        .view(torch.float64).reshape(shape)
        for ws, shape in zip(words, shapes)
    ]
    for v, t in zip(params, values):  # all validated: install
        v.storage.write_host(t.to(v.dtype))


@dataclass(frozen=True)
class Loaded:
    """What ``load`` read: the format, and for ``TLADAMF`` the optimizer file."""

    format: str
    adam: Optional[AdamFile] = None


def detect_format(path: PathLike) -> str:
    """``"TLPF32B"``, ``"TLADAMF"`` or the JSON format tag, from the file's first bytes."""
    head = read_regular("load", path, 7)
    if head in (MAGIC_F32, b"TLADAMF"):
        return head.decode()
    if head.lstrip()[:1] == b"{":
        doc = read_json(f"load: {path}", path)
        if isinstance(doc, dict) and isinstance(doc.get("format"), str):
            return doc["format"]
    raise CheckpointError(f"load: {path}: not a TorchLean file (no known magic or format tag)")


def load(path: PathLike, target, optimizer=None) -> Loaded:
    """Read any TorchLean file into ``target``, choosing the reader by the file's magic or
    format tag (as upstream's ``NN/API/Checkpoint.lean`` does). Parameter files are
    installed; a ``TLADAMF`` file returns its optimizer state in ``Loaded.adam``."""
    fmt = detect_format(path)
    if fmt == "TLPF32B":
        read_torchlean_f32(path, target)
    elif fmt == "TLADAMF":
        return Loaded(fmt, read_torchlean_adam(path, target, optimizer))
    elif fmt == BITS_FORMAT:
        read_torchlean_bits(path, target)
    elif fmt in STATE_FORMATS:
        read_torchlean_state(path, target)
    else:
        raise CheckpointError(f"load: {path}: unknown TorchLean format {fmt!r}")
    return Loaded(fmt)
