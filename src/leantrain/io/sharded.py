"""Sharded checkpoints: a folder with one safetensors file per rank and an index.

A sharded run (``sharding=...``) saves into a folder. Each rank writes one file with the
pieces of optimizer state it owns (``state.<slot>.<name>@<start>``: a flat range of the
whole tensor); rank 0's file also holds what every rank has whole (parameters, buffers,
the moving average, generator and loader states). ``index.json`` is written last and
atomically: the usual manifest (schema, alias map, frozen mask, optimizer, progress,
loader and RNG state, a checksum per whole tensor), the world size, every file with its
size, and every piece with its range and CRC-32C. Until the new index replaces the old
one, the old index and its files are the checkpoint: a crash between the writes leaves
the previous checkpoint whole. Files of generations no index names are removed after
the index is written. No pickle anywhere.

Reading checks everything before anything is used: the index's own checksum and format,
that every file it names is present, of its size and readable, that every piece passes
its checksum, that the pieces of each tensor tile it exactly (no gap, no overlap), that
the world size matches the files, and that the folder holds no file the index does not
name (but older generations' shards). The pieces are then put together, so a sharded
checkpoint loads like a single file: at any world size, sharded or not.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from .atomic import atomic_write, atomic_write_bytes
from .checkfile import checksum, manifest_of, raise_all, seal, tensor_list_problems, unseal
from .manifest import expected_tensors
from .tensorfile import TensorFile
from ..errors import CheckpointError

INDEX = "index.json"
FORMAT, VERSION = "leantrain.sharded-checkpoint", 1
SHARD = re.compile(r"(g[0-9]{8}-[0-9a-f]{8})\.rank-([0-9]{5})-of-([0-9]{5})\.safetensors")


def shard_name(generation: str, rank: int, world: int) -> str:
    return f"{generation}.rank-{rank:05d}-of-{world:05d}.safetensors"


def piece_key(name: str, start: int) -> str:
    return f"{name}@{start}"


# ------------------------------------------------------------------------ write
def write_shard(folder: Path, generation: str, rank: int, world: int, tensors: dict, pieces: dict) -> dict:
    """This rank's file: ``tensors`` (whole, rank 0) and ``pieces`` (``(name, start) ->
    flat tensor``); returns its index entry."""
    stored = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
    listed = {}
    for (name, start), t in pieces.items():
        flat = t.detach().to("cpu").contiguous().reshape(-1)  # intentional device-to-host read: saving
        stored[piece_key(name, start)] = flat
        listed.setdefault(name, []).append({"start": start, "stop": start + flat.numel(), "crc32c": checksum(flat)})
    name = shard_name(generation, rank, world)

    def write(tmp: Path) -> None:
        save_file(stored, str(tmp))

    atomic_write(folder / name, write, "save_checkpoint")
    return {"name": name, "rank": rank, "bytes": (folder / name).stat().st_size, "pieces": listed}


def write_index(folder: Path, manifest: dict, world: int, generation: str, files: list) -> Path:
    """The index (rank 0, after every rank's file is written), then older shards removed."""
    pieces: dict = {}
    for f in files:
        for name, parts in f["pieces"].items():
            pieces.setdefault(name, []).extend(dict(p, file=f["name"]) for p in parts)
    index = {"format": FORMAT, "version": VERSION, "world": world, "generation": generation,
             "manifest": seal(json.dumps(manifest, sort_keys=True)),
             "files": [{"name": f["name"], "rank": f["rank"], "bytes": f["bytes"]} for f in files],
             "pieces": {n: sorted(p, key=lambda x: x["start"]) for n, p in sorted(pieces.items())}}
    path = atomic_write_bytes(folder / INDEX, seal(json.dumps(index, sort_keys=True)).encode(), "save_checkpoint")
    keep = {f["name"] for f in files}
    for entry in os.scandir(folder):
        if SHARD.fullmatch(entry.name) and entry.name not in keep:
            os.remove(entry.path)  # a generation no index names any more
    return path


def check_folder(op: str, path: object) -> Path:
    """``path`` as a folder a sharded checkpoint can be written to (absent, or a folder)."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise CheckpointError(f"{op}: expected a folder path, got {path!r}")
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{op}: {path}: is a file; a sharded run saves a folder (one file per rank and "
                              f"an index): give a folder path")
    return path


# ------------------------------------------------------------------------- read
def read_index(folder: Path, op: str) -> dict:
    """The folder's index, checked for its checksum, format and shape."""
    path = folder / INDEX
    if not path.is_file():
        raise CheckpointError(f"{op}: {folder}: a folder without {INDEX}: not a checkpoint (a sharded save that "
                              f"never finished its first index, or the wrong folder)")
    try:
        text = unseal(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{op}: {path}: unreadable ({e})") from None
    if text is None:
        raise CheckpointError(f"{op}: {path}: the index fails its checksum (the file is corrupt)")
    try:
        index = json.loads(text)
    except ValueError:
        raise CheckpointError(f"{op}: {path}: the index is not valid JSON") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != VERSION:
        raise CheckpointError(f"{op}: {path}: not a {FORMAT} index of version {VERSION}")
    return index


def read_folder(folder: Path, op: str):
    """``(manifest, tensors, checked)`` of a sharded checkpoint, as ``read_checked`` gives
    a file's: every file and piece verified, the pieces put together."""
    index = read_index(folder, op)
    manifest, checked = manifest_of(index.get("manifest"), op, folder)
    world, files = index.get("world"), index.get("files")
    problems = []
    if not (isinstance(world, int) and world >= 1 and isinstance(files, list)
            and sorted(f.get("rank") for f in files if isinstance(f, dict)) == list(range(world))):
        raise_all(op, folder, [f"the index names files of ranks {[f.get('rank') for f in files or []]}, "
                               f"not one per rank of its world size {world!r}"])
    names = {f["name"] for f in files}
    for entry in os.scandir(folder):
        m = SHARD.fullmatch(entry.name)
        if entry.name == INDEX or entry.name in names or (m and m.group(1) != index.get("generation")):
            continue
        if entry.name.startswith(".leantrain-tmp-"):
            continue  # a writer's scratch (removed by the next save)
        problems.append(f"stray file {entry.name!r} (the index does not name it)")
    stored: dict = {}
    for f in files:
        p = folder / f["name"]
        if not p.is_file():
            problems.append(f"missing file {f['name']!r} (rank {f['rank']})")
        elif p.stat().st_size != f["bytes"]:
            problems.append(f"file {f['name']!r} is {p.stat().st_size} bytes, the index says {f['bytes']}")
    raise_all(op, folder, problems)
    for f in files:
        with TensorFile(folder / f["name"], op) as tf:
            for key in tf.entries:
                stored[key] = tf.read(key)  # a view of the file's private mapping (valid after close)
    want = expected_tensors(manifest)
    tensors: dict = {}
    pieces = index.get("pieces", {})
    for name, parts in pieces.items():
        whole = _assembled(name, parts, stored, want, problems)
        if whole is not None:
            tensors[name] = whole
    listed = {piece_key(n, p.get("start")) for n, parts in pieces.items() for p in parts}
    for key, t in stored.items():
        if "@" not in key:
            tensors[key] = t
        elif key not in listed:
            problems.append(f"unexpected piece {key!r} (the index does not name it)")
    for name in sorted(set(tensors) & set(manifest["checksums"])):
        if checksum(tensors[name], manifest["version"]) != manifest["checksums"][name]:
            problems.append(f"tensor {name!r} fails its checksum (the file is corrupt)")
    raise_all(op, folder, problems)
    manifest = dict(manifest, checksums=dict(manifest["checksums"], **{
        n: checksum(tensors[n], manifest["version"]) for n in pieces}))
    problems = tensor_list_problems(manifest, want, {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()})
    raise_all(op, folder, problems)
    return manifest, tensors, checked


def _assembled(name: str, parts: list, stored: dict, want: dict, problems: list) -> Optional[torch.Tensor]:
    """One tensor from its pieces, which must pass their checksums and tile it."""
    if name not in want:
        problems.append(f"unexpected tensor {name!r} (the manifest does not describe it)")
        return None
    dtype, shape = want[name]
    numel = 1
    for d in shape or ():
        numel *= d
    at = 0
    flat = torch.empty(numel, dtype=dtype)
    for p in sorted(parts, key=lambda x: x.get("start", -1)):
        key = piece_key(name, p.get("start"))
        t = stored.get(key)
        if p.get("start") != at:
            problems.append(f"tensor {name!r}: pieces leave a gap or overlap at element {at} "
                            f"(the next piece starts at {p.get('start')})")
            return None
        if t is None or t.dtype != dtype or t.dim() != 1 or t.numel() != p.get("stop", -1) - at:
            problems.append(f"tensor {name!r}: piece [{at}, {p.get('stop')}) is missing or of the wrong size or dtype "
                            f"in {p.get('file')!r}")
            return None
        if checksum(t) != p.get("crc32c"):
            problems.append(f"tensor {name!r}: piece [{at}, {p.get('stop')}) in {p.get('file')!r} fails its "
                            f"checksum (the file is corrupt)")
            return None
        flat[at: p["stop"]] = t
        at = p["stop"]
    if at != numel:
        problems.append(f"tensor {name!r}: its pieces cover {at} of its {numel} elements")
        return None
    return flat.view(shape) if shape is not None else flat


def describe_folder(folder: Path) -> str:
    """One line on a sharded folder: its ranks, files and bytes."""
    index = read_index(folder, "inspect")
    size = sum(f["bytes"] for f in index["files"]) + (folder / INDEX).stat().st_size
    return f"sharded over {index['world']} rank(s): {len(index['files'])} files and {INDEX}, {size:,} bytes"
