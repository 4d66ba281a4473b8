"""TorchLean's own module-parameter formats (spec §9.2, §9.4), byte for byte.

* The float32 stream: ASCII magic ``TLPF32B``, u64 version 2, u64 slot count, then
  per slot a u64 rank, the u64 dims, a u64 element count and the values as
  little-endian float32. Every slot is written (frozen buffers too, aliases once per
  slot). Values are rounded to float32.
* The JSON bit patterns: ``{"format": "torchlean_paramlist_bits_v1", "params":
  [{"shape": [...], "values": [...]}]}``, values being the binary64 bit patterns.

Both readers validate the whole file first (header, count, every shape and
payload length, no trailing data) and only then write the parameters.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from .atomic import PathLike, atomic_write_bytes
from ..params.paramlist import params_of
from .checkpoint import current_value
from ..errors import CheckpointError, shape_str
from ..validate import is_int

MAGIC_F32, VERSION_F32 = b"TLPF32B", 2
BITS_FORMAT = "torchlean_paramlist_bits_v1"
U64 = struct.Struct("<Q")


def _u64(n: int) -> bytes:
    if not 0 <= n < 2**64:
        raise CheckpointError(f"torchlean: value {n} does not fit in an unsigned 64-bit field")
    return U64.pack(n)


def encode_f32(target) -> bytes:
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
    return atomic_write_bytes(path, encode_f32(target))


class _Reader:
    def __init__(self, data: bytes, op: str) -> None:
        self.data, self.pos, self.op = data, 0, op

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise CheckpointError(
                f"{self.op}: truncated checkpoint (wanted {n} bytes, got {len(self.data) - self.pos})"
            )
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def u64(self) -> int:
        return U64.unpack(self.take(8))[0]


def read_torchlean_f32(path: PathLike, target) -> None:
    """Validate the float32 stream against ``target``'s slots, then host-write every slot."""
    params = params_of("read_torchlean_f32", target)
    op = f"read_torchlean_f32: {path}"
    r = _Reader(Path(path).read_bytes(), op)
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
    if r.pos != len(r.data):
        raise CheckpointError(f"{op}: {len(r.data) - r.pos} trailing bytes after the last slot")
    for v, t in zip(params, values):  # all validated: install
        v.storage.write_host(t.to(v.dtype))


def write_torchlean_bits(path: PathLike, target) -> Path:
    """Write the JSON bit-pattern file (binary64 bits of every value, row-major)."""
    params = params_of("write_torchlean_bits", target)
    records = []
    for v in params:
        t = current_value(v.storage).to(torch.float64).contiguous().reshape(-1)
        bits = t.view(torch.int64).tolist()
        records.append({"shape": list(v.shape), "values": [b & (2**64 - 1) for b in bits]})
    text = json.dumps({"format": BITS_FORMAT, "params": records}, separators=(",", ":"))
    return atomic_write_bytes(path, text.encode())


def read_torchlean_bits(path: PathLike, target) -> None:
    """Validate the JSON bit-pattern file against ``target``, then host-write every slot."""
    params = params_of("read_torchlean_bits", target)
    op = f"read_torchlean_bits: {path}"
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{op}: not a readable JSON file ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != BITS_FORMAT:
        raise CheckpointError(f"{op}: format tag must be {BITS_FORMAT!r}")
    records = doc.get("params")
    if not isinstance(records, list):
        raise CheckpointError(f"{op}: 'params' must be a list")
    if len(records) > len(params):
        raise CheckpointError(f"{op}: unexpected {len(records) - len(params)} trailing parameter record(s)")
    values = []
    shapes = params.schema().shapes  # the layout the file must match
    for i, v in enumerate(params):
        if i >= len(records):
            raise CheckpointError(f"{op}: missing parameter {i}/{len(params)}")
        rec = records[i]
        if not isinstance(rec, dict) or tuple(rec.get("shape", ())) != shapes[i]:
            got = rec.get("shape") if isinstance(rec, dict) else rec
            raise CheckpointError(f"{op}: slot {i}: expected shape {shape_str(shapes[i])}, got {got!r}")
        bits = rec.get("values")
        n = v.storage.host.numel()
        if not isinstance(bits, list) or len(bits) != n:
            raise CheckpointError(f"{op}: slot {i}: expected {n} values, got {len(bits) if isinstance(bits, list) else bits!r}")
        if any(not is_int(b) or not 0 <= b < 2**64 for b in bits):
            raise CheckpointError(f"{op}: slot {i}: every value must be a natural number below 2^64")
        signed = [b - 2**64 if b >= 2**63 else b for b in bits]
        values.append(torch.tensor(signed, dtype=torch.int64).view(torch.float64).reshape(v.shape))
    for v, t in zip(params, values):
        v.storage.write_host(t.to(v.dtype))
