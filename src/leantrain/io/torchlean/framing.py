"""TorchLean's binary framing (spec §9.2): little-endian unsigned 64-bit integers, read
with exact, named failures."""

from __future__ import annotations

import struct

from ...errors import CheckpointError

U64 = struct.Struct("<Q")


def u64(n: int, op: str = "write") -> bytes:
    """``n`` as a little-endian u64; a value that does not fit is an error."""
    if not 0 <= n < 2**64:
        raise CheckpointError(f"{op}: value {n} does not fit in an unsigned 64-bit field")
    return U64.pack(n)


class ByteReader:
    """Reads a byte string front to back; a short read names both lengths."""

    def __init__(self, data: bytes, op: str) -> None:
        self.data, self.pos, self.op = data, 0, op

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise CheckpointError(f"{self.op}: truncated checkpoint (wanted {n} bytes, got {len(self.data) - self.pos})")
        chunk = self.data[self.pos: self.pos + n]
        self.pos += n
        return chunk

    def u64(self) -> int:
        return U64.unpack(self.take(8))[0]

    def shape(self) -> tuple[tuple[int, ...], int]:
        """A rank, that many dims, then an element count."""
        dims = tuple(self.u64() for _ in range(self.u64()))
        return dims, self.u64()

    def trailing(self) -> int:
        return len(self.data) - self.pos
