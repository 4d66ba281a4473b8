"""TorchLean's trainer-state JSON (spec §9.4): the model state as per-scalar bit words.

``torchlean_state_bits_v1`` holds binary64 words, ``torchlean_state_float32_bits_v1``
binary32 words. The spec gives the tags and the scalar encodings, not the layout; it is
read here as the parameter-bits layout (``{"params": [{"values": [...], "shape":
[...]}], "format": TAG}``, keys in upstream's printing order). A NaN must be the
canonical word (``0x7ff8000000000000``, ``0x7fc00000``): any other NaN payload is
rejected, and the writer writes every NaN canonically. Like upstream, this replaces
the model state only; an optimizer history is not part of it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...errors import CheckpointError
from ...params.paramlist import params_of
from ..atomic import PathLike, atomic_write_bytes
from ..checkpoint import current_value
from ..regular import read_json
from .bits import bits_document, read_bits_records

STATE_FORMATS = {
    "torchlean_state_bits_v1": (torch.float64, torch.int64, 64, 0x7FF8000000000000),
    "torchlean_state_float32_bits_v1": (torch.float32, torch.int32, 32, 0x7FC00000),
}


def _is_nan_word(w: int, bits: int) -> bool:
    exp_bits = 11 if bits == 64 else 8
    mant = bits - 1 - exp_bits
    exponent = (w >> mant) & ((1 << exp_bits) - 1)
    return exponent == (1 << exp_bits) - 1 and (w & ((1 << mant) - 1)) != 0


def write_torchlean_state(path: PathLike, target, *, float32: bool = False, pretty: bool = True) -> Path:
    """Write the model state as binary64 (default) or binary32 words."""
    params = params_of("write_torchlean_state", target)
    fmt = "torchlean_state_float32_bits_v1" if float32 else "torchlean_state_bits_v1"
    dtype, word, bits, canonical = STATE_FORMATS[fmt]
    records = []
    for v in params:
        t = current_value(v.storage).to(dtype).contiguous().reshape(-1)
        words = [w & ((1 << bits) - 1) for w in t.view(word).tolist()]
        words = [canonical if _is_nan_word(w, bits) else w for w in words]
        records.append((list(v.shape), words))
    return atomic_write_bytes(path, bits_document(fmt, records, pretty), "write_torchlean_state")


def read_torchlean_state(path: PathLike, target) -> str:
    """Validate a trainer-state file against ``target`` (format tag, shapes, counts,
    canonical NaNs), then host-write every slot. Returns the format tag."""
    params = params_of("read_torchlean_state", target)
    op = f"read_torchlean_state: {path}"
    doc = read_json(op, path)
    fmt = doc.get("format") if isinstance(doc, dict) else None
    if fmt not in STATE_FORMATS:
        raise CheckpointError(f"{op}: format tag must be one of {sorted(STATE_FORMATS)}, got {fmt!r}")
    dtype, word, bits, canonical = STATE_FORMATS[fmt]
    shapes = list(params.schema().shapes)
    records = read_bits_records(op, doc, fmt, shapes, bits)
    for i, words in enumerate(records):
        bad = [w for w in words if _is_nan_word(w, bits) and w != canonical]
        if bad:
            raise CheckpointError(f"{op}: slot {i}: non-canonical NaN word {bad[0]:#x}")
    sign = 1 << (bits - 1)
    values = [
        torch.tensor([w - (1 << bits) if w >= sign else w for w in ws], dtype=word).view(dtype).reshape(shape)
        for ws, shape in zip(records, shapes)
    ]
    for v, t in zip(params, values):  # all validated: install
        v.storage.write_host(t.to(v.dtype))
    return fmt
