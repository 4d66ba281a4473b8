"""The checkpoint file as bytes on disk: the sealed manifest, and reading a file back
with its integrity checked (format, version, manifest schema, tensor list, checksums)
before anything uses it."""

from __future__ import annotations

import json
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import crc32c
import torch

from ..errors import CheckpointError, shape_str
from .atomic import PathLike
from .manifest import Checked, check_manifest, expected_tensors
from .tensorfile import TensorFile

# Version 2 checksums each tensor with CRC-32C (hardware accelerated, ~17 GB/s per thread
# here); version 1, CRC-32 (zlib, ~3.4 GB/s), is still read.
FORMAT, VERSION = "leantrain.checkpoint", 2
READABLE = (1, 2)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _bytes(t: torch.Tensor):
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy()


def crc32(t: torch.Tensor) -> int:
    """CRC-32 (zlib) of the tensor's bytes: version-1 files."""
    return zlib.crc32(_bytes(t)) if t.numel() else 0


def checksum(t: torch.Tensor, version: int = VERSION) -> int:
    """The per-tensor checksum of a file of ``version``: CRC-32C from version 2."""
    if version == 1:
        return crc32(t)
    return crc32c.crc32c(_bytes(t)) if t.numel() else 0


def seal(text: str) -> str:
    """The manifest as stored: its CRC-32 in hex, a space, then the JSON text (one
    metadata entry, so the header bytes are deterministic)."""
    return f"{zlib.crc32(text.encode()):08x} {text}"


def unseal(sealed: str) -> Optional[str]:
    """The JSON text of a sealed manifest, or ``None`` when it fails its checksum."""
    crc, _, text = sealed.partition(" ")
    return text if crc == f"{zlib.crc32(text.encode()):08x}" else None


def read_checkpoint(path: PathLike, op: str = "read_checkpoint") -> tuple[dict, dict[str, torch.Tensor]]:
    """The manifest and every tensor, with the file checked as a whole: format and
    version, the manifest's schema (types and ranges), the tensor list against what
    the manifest implies (names, dtypes, shapes: from the header, before any tensor
    is read), then every checksum. Header and data come from one open file, so a
    concurrent atomic replacement cannot mix two files. Raises ``CheckpointError``
    listing every problem."""
    manifest, tensors, _ = read_checked(path, op)
    return manifest, tensors


def read_manifest(path: PathLike, op: str) -> dict:
    """The manifest of a checkpoint file alone (its header: format, version and schema
    checked; no tensor read): what a file says it is, for identity checks."""
    path = Path(path)
    with TensorFile(path, op) as f:
        return manifest_of(f.metadata.get("leantrain"), op, path)[0]


def read_checked(path: PathLike, op: str) -> tuple[dict, dict[str, torch.Tensor], Checked]:
    """``read_checkpoint``, with what the manifest's check built (its schema, its
    optimizer's hyperparameters): a sound file, internally consistent (every tensor the
    manifest implies, of the dtype and shape it implies)."""
    path = Path(path)
    with TensorFile(path, op) as f:
        manifest, checked = manifest_of(f.metadata.get("leantrain"), op, path)
        want = expected_tensors(manifest)
        problems = tensor_list_problems(manifest, want, {n: (e.dtype, e.shape) for n, e in f.entries.items()})
        raise_all(op, path, problems)
        names = sorted(want)
        tensors = {n: f.read(n) for n in names}
    with ThreadPoolExecutor(max_workers=2) as pool:  # both checksums release the GIL
        actual = list(pool.map(lambda n: checksum(tensors[n], manifest["version"]), names))
    for name, got in zip(names, actual):
        if got != manifest["checksums"][name]:
            problems.append(f"tensor {name!r} fails its checksum (the file is corrupt)")
    raise_all(op, path, problems)
    return manifest, tensors, checked


def tensor_list_problems(manifest: dict, want: dict, entries: dict) -> list[str]:
    """The stored tensors (``name -> (dtype, shape)``) against what the manifest implies
    (``want``), and the checksum list against the manifest's tensors."""
    problems = []
    for name in sorted(set(want) - set(entries)):
        problems.append(f"missing tensor {name!r}")
    for name in sorted(set(entries) - set(want))[:20]:
        problems.append(f"unexpected tensor {name!r} (the manifest does not describe it)")
    if len(set(entries) - set(want)) > 20:
        problems.append(f"... {len(set(entries) - set(want)) - 20} more unexpected tensors")
    if set(manifest["checksums"]) != set(want):
        problems.append("the checksum list does not name exactly the manifest's tensors")
    for name in sorted(set(want) & set(entries)):
        (dtype, shape), (e_dtype, e_shape) = want[name], entries[name]
        if e_dtype != dtype or (shape is None and len(e_shape) != 1) or (shape is not None and tuple(e_shape) != shape):
            problems.append(
                f"tensor {name!r} is {shape_str(tuple(e_shape))} {dtype_name(e_dtype)} in the file; the manifest says "
                f"{'1-D' if shape is None else shape_str(shape)} {dtype_name(dtype)}"
            )
    return problems


def manifest_of(sealed: Optional[str], op: str, path: Path) -> tuple[dict, Checked]:
    """A sealed manifest's JSON, checked: format, version and schema."""
    if sealed is None:
        raise CheckpointError(f"{op}: {path}: no leantrain manifest in the file")
    text = unseal(sealed)
    if text is None:
        raise CheckpointError(f"{op}: {path}: the manifest fails its checksum (the file is corrupt)")
    try:
        manifest = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{op}: {path}: the manifest is not valid JSON ({type(e).__name__})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{op}: {path}: the manifest is not a JSON object")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{op}: {path}: unsupported format {manifest.get('format')!r:.80}; expected {FORMAT!r}")
    if manifest.get("version") not in READABLE or not isinstance(manifest.get("version"), int):
        raise CheckpointError(
            f"{op}: {path}: unsupported format version {manifest.get('version')!r:.80}; expected one of {READABLE}"
        )
    checked = check_manifest(manifest)
    raise_all(op, path, checked.problems)
    return manifest, checked


def raise_all(op: str, path: Path, problems: list[str], fix: str = "") -> None:
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise CheckpointError(
            f"{op}: {path}: {len(problems)} problem(s), nothing was loaded:\n{lines}{fix}"
        )
