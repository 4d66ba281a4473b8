"""Reading a safetensors file through one open file descriptor, header first.

Why not ``safe_open``: it opens the file by name, and leantrain reads a checkpoint's
manifest and its tensors as one file: a reader racing an atomic writer could take the
header from one file and the data from the next (two opens by name). (``safe_open``
validates the header when it opens; that is not the reason.) Here the file is opened
once; the header is parsed and bounded (its size, every entry's dtype, shape and byte
range) before a single tensor byte is read, so the caller can compare the list of
tensors with what it expects and reject strays for the price of the header.

Tensors are views of a private copy-on-write mapping of the open file (no copy until
written, as safetensors' own reader maps files): an atomic replacement of the path does
not touch the mapped bytes. Like any mapping, it assumes nobody truncates the file in
place while its tensors are alive (leantrain's writers never do).

The format: a little-endian u64 header length, that many bytes of JSON (an object
mapping each tensor name to ``{"dtype", "shape", "data_offsets"}``, plus an optional
``"__metadata__"`` object of strings), then the data, little-endian, each tensor at
``data_offsets`` relative to the end of the header.
"""

from __future__ import annotations

import json
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import crc32c
import torch

from ..errors import CheckpointError
from .atomic import checked_path

MAX_HEADER = 100 * 2**20  # the bound the safetensors library itself applies
MAX_RANK = 64

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
                     ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)


@dataclass(frozen=True)
class Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


class TensorFile:
    """An open safetensors file: ``metadata``, ``entries`` (name -> Entry), ``read(name)``."""

    def __init__(self, path: Path, op: str) -> None:
        path = checked_path(op, path)
        self.path, self.op = path, op
        self.map: Optional[mmap.mmap] = None
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the open
        except IsADirectoryError:
            raise CheckpointError(f"{op}: {path}: is a folder, not a checkpoint file") from None
        except FileNotFoundError:
            raise CheckpointError(f"{op}: {path}: no such checkpoint file") from None
        except OSError as e:
            raise CheckpointError(f"{op}: {path}: cannot be opened ({e.strerror or e})") from None
        try:
            mode = os.fstat(self.fd).st_mode
            if stat.S_ISDIR(mode):
                raise CheckpointError(f"{op}: {path}: is a folder, not a checkpoint file")
            if not stat.S_ISREG(mode):
                raise CheckpointError(f"{op}: {path}: is not a regular file (a FIFO, socket or device)")
            os.set_blocking(self.fd, True)
            self._read_header()
        except OSError as e:
            os.close(self.fd)
            raise CheckpointError(f"{op}: {path}: cannot be read ({e.strerror or e})") from None
        except BaseException:
            os.close(self.fd)
            raise

    def __enter__(self) -> "TensorFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _fail(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.op}: {self.path}: not a readable checkpoint ({why})")

    def _pread(self, n: int, offset: int, buf=None):
        """``n`` bytes at ``offset`` into ``buf`` (a writable buffer; default: a new bytearray)."""
        buf = bytearray(n) if buf is None else buf
        view, done = memoryview(buf).cast("B"), 0
        while done < n:
            try:
                got = os.preadv(self.fd, [view[done:]], offset + done)
            except OSError as e:
                raise self._fail(f"reading {n} bytes at {offset}: {e.strerror or e}") from None
            if got == 0:
                raise self._fail(f"the file ends after {offset + done} bytes, {n - done} short")
            done += got
        return buf

    def _read_header(self) -> None:
        size = os.fstat(self.fd).st_size
        if size < 8:
            raise self._fail(f"{size} bytes, too short for a header")
        (n,) = struct.unpack("<Q", self._pread(8, 0))
        if n > MAX_HEADER or n > size - 8:
            raise self._fail(f"header length {n} exceeds the file ({size} bytes) or {MAX_HEADER} bytes")
        try:
            header = json.loads(bytes(self._pread(n, 8)).decode("utf-8"))
        except (ValueError, RecursionError) as e:
            raise self._fail(f"the header is not JSON: {type(e).__name__}") from None
        if not isinstance(header, dict):
            raise self._fail("the header is not a JSON object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise self._fail("the header's metadata is not a map of strings")
        self.metadata: dict[str, str] = meta
        self.data_start = 8 + n
        data_len = size - self.data_start
        self.entries: dict[str, Entry] = {}
        for name, e in header.items():
            self.entries[name] = self._entry(name, e, data_len)
        # The tensors tile the data exactly: no gap, no overlap, nothing after the last.
        end = 0
        for e in sorted(self.entries.values(), key=lambda e: (e.begin, e.end)):
            if e.begin != end:
                raise self._fail(f"the tensors do not tile the data (a {'gap' if e.begin > end else 'overlap'} "
                                 f"at byte {min(end, e.begin)})")
            end = e.end
        if end != data_len:
            raise self._fail(f"{data_len - end} bytes after the last tensor")

    def _entry(self, name: str, e: object, data_len: int) -> Entry:
        bad = self._fail
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"tensor {name!r}: entry is not {{dtype, shape, data_offsets}}")
        dtype = DTYPES.get(e["dtype"]) if isinstance(e["dtype"], str) else None
        if dtype is None:
            raise bad(f"tensor {name!r}: unknown dtype {e['dtype']!r}")
        shape, offsets = e["shape"], e["data_offsets"]
        if not (isinstance(shape, list) and len(shape) <= MAX_RANK and all(_nat(d) for d in shape)):
            raise bad(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_nat(x) for x in offsets)):
            raise bad(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
        begin, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        want = numel * torch.empty((), dtype=dtype).element_size()
        if not begin <= end <= data_len or end - begin != want:
            raise bad(f"tensor {name!r}: bytes [{begin}, {end}) do not hold {shape} {e['dtype']} "
                      f"within the {data_len} data bytes")
        return Entry(dtype, tuple(shape), begin, end)

    def crc32c_of(self, name: str, chunk: int = 8 << 20) -> int:
        """CRC-32C of tensor ``name``'s bytes, read through one buffer of ``chunk`` bytes
        (nothing of the file stays in this process's memory)."""
        e = self.entries[name]
        n, crc, done = e.end - e.begin, 0, 0
        buf = bytearray(min(chunk, n))
        while done < n:
            k = min(len(buf), n - done)
            view = memoryview(buf)[:k]
            self._pread(k, self.data_start + e.begin + done, view)
            crc = crc32c.crc32c(view, crc)
            done += k
        return crc

    def read_into(self, name: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Elements ``[start, stop)`` of tensor ``name`` (flat) read from the file into
        ``out`` (a contiguous CPU tensor of that many elements and its dtype): only those
        bytes are read, into memory the caller holds."""
        e = self.entries[name]
        size = out.element_size()
        n = (stop - start) * size
        if not (0 <= start <= stop and e.begin + stop * size <= e.end and out.dtype == e.dtype
                and out.is_contiguous() and out.numel() == stop - start):
            raise self._fail(f"tensor {name!r}: elements [{start}, {stop}) asked outside it or into a wrong buffer")
        if n:
            self._pread(n, self.data_start + e.begin + start * size, out.view(torch.uint8).numpy())

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name``, on the CPU, owning its memory."""
        e = self.entries[name]
        if e.end == e.begin:
            return torch.empty(e.shape, dtype=e.dtype)
        if self.map is None:
            # A private copy-on-write mapping of this same open file: no copy until written,
            # the bytes of the file opened (a rename over the path does not change them).
            self.map = mmap.mmap(self.fd, 0, access=mmap.ACCESS_COPY)
        n = e.end - e.begin
        out = torch.frombuffer(self.map, dtype=torch.uint8, count=n, offset=self.data_start + e.begin)
        return out.view(e.dtype).reshape(e.shape)


def _nat(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**63
