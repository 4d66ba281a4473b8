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

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors.torch import save_file

from .atomic import SCRATCH, atomic_write, atomic_write_bytes, checked_path, process_alive, remove_dead_scratch
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
    replaced = _generation_of(folder)  # the index this one replaces (None: none, or unreadable)
    path = atomic_write_bytes(folder / INDEX, seal(json.dumps(index, sort_keys=True)).encode(), "save_checkpoint")
    # Only files this save knows are superseded go: the generation of the index it replaced, once the
    # folder's index is verified to be its own (a concurrent writer's index and files are never touched).
    if _generation_of(folder) == generation:
        live = live_generations(folder)
        for entry in os.scandir(folder):
            m = SHARD.fullmatch(entry.name)
            g = m.group(1) if m else None
            if g is not None and g != generation and (g == replaced or g not in live) \
                    and entry.is_file(follow_symlinks=False):
                os.remove(entry.path)  # superseded by this index, or left by a writer that died
    remove_dead_scratch(folder)  # what killed writers left (a full-size shard each)
    return path


MARKER = re.compile(r"\.leantrain-gen-(g[0-9]{8}-[0-9a-f]{8})-([0-9]+)")


@contextlib.contextmanager
def generation_marked(folder: Path, generation: str):
    """While a save of ``generation`` is in flight, a marker names its writer's process, so
    a concurrent save never deletes its shards; a marker of a dead process is removed
    (with its generation's shards, which no index names) by the next successful save."""
    marker = folder / f".leantrain-gen-{generation}-{os.getpid()}"
    marker.touch(exist_ok=False)
    try:
        yield
    finally:
        marker.unlink(missing_ok=True)


def live_generations(folder: Path) -> set[str]:
    """The generations whose writers are alive (their markers' processes); dead markers go."""
    live = set()
    for entry in os.scandir(folder):
        m = MARKER.fullmatch(entry.name)
        if m is None or not entry.is_file(follow_symlinks=False):
            continue
        if process_alive(int(m.group(2))):
            live.add(m.group(1))
        else:
            os.remove(entry.path)
    return live


def _generation_of(folder: Path) -> Optional[str]:
    """The generation the folder's index names, if it reads back whole."""
    try:
        return read_index(folder, "save_checkpoint")["generation"]
    except CheckpointError:
        return None


def check_folder(op: str, path: object) -> Path:
    """``path`` as a folder a sharded checkpoint can be written to (absent, or a folder)."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise CheckpointError(f"{op}: expected a folder path, got {path!r}")
    path = checked_path(op, path)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{op}: {path}: is a file; a sharded run saves a folder (one file per rank and "
                              f"an index): give a folder path")
    if path.is_dir():
        others = [e.name for e in os.scandir(path) if not (
            (e.name == INDEX or SHARD.fullmatch(e.name)) and e.is_file(follow_symlinks=False)
            or SCRATCH.fullmatch(e.name) and e.is_dir(follow_symlinks=False)
            or MARKER.fullmatch(e.name) and e.is_file(follow_symlinks=False))]
        if others:
            raise CheckpointError(f"{op}: {path}: holds files that are not a sharded checkpoint's "
                                  f"({', '.join(sorted(others)[:3])}); a sharded run writes into its own folder: "
                                  f"give an empty or new one")
    return path


# ------------------------------------------------------------------------- read
def read_index(folder: Path, op: str) -> dict:
    """The folder's index, checked for its checksum, format and shape."""
    path = folder / INDEX
    if path.is_symlink():
        raise CheckpointError(f"{op}: {path}: is a symbolic link; a checkpoint folder's files are its own")
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
    except (ValueError, RecursionError):
        raise CheckpointError(f"{op}: {path}: the index is not valid JSON (or nests too deep)") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != VERSION:
        raise CheckpointError(f"{op}: {path}: not a {FORMAT} index of version {VERSION}")
    raise_all(op, folder, index_problems(index))
    return index


def _is_count(v, low: int = 0, high: int = 2**62) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and low <= v <= high


def index_problems(index: dict) -> list[str]:
    """Why an index's own fields cannot be used, checked before any is (each file it names
    must be exactly the shard name of its rank in this generation: a plain name in the
    folder, never a path out of it)."""
    world, generation, files, pieces = (index.get(k) for k in ("world", "generation", "files", "pieces"))
    if not _is_count(world, 1, 99999):
        return [f"world: expected an integer in [1, 99999], got {world!r:.40}"]
    if not (isinstance(generation, str) and re.fullmatch(r"g[0-9]{8}-[0-9a-f]{8}", generation)):
        return [f"generation: expected a generation name, got {generation!r:.40}"]
    if not isinstance(index.get("manifest"), str):
        return ["manifest: expected the sealed manifest text"]
    if not (isinstance(files, list) and len(files) == world and all(
            isinstance(f, dict) and _is_count(f.get("rank"), 0, world - 1) and _is_count(f.get("bytes"))
            for f in files) and sorted(f["rank"] for f in files) == list(range(world))):
        ranks = [f.get("rank") for f in files[:8] if isinstance(f, dict)] if isinstance(files, list) else files
        return [f"files: the index names files of ranks {ranks!r:.60}, not one per rank of its world size {world} "
                f"({{name, rank, bytes}} each)"]
    wrong = [f.get("name") for f in files if f.get("name") != shard_name(generation, f["rank"], world)]
    if wrong:
        return [f"files: {wrong[0]!r:.80} is not the shard name of its rank (a file of this folder)"]
    names = {f["name"] for f in files}
    if not (isinstance(pieces, dict) and all(
            isinstance(n, str) and isinstance(parts, list) and all(
                isinstance(p, dict) and _is_count(p.get("start")) and _is_count(p.get("stop"))
                and p["start"] <= p["stop"] and _is_count(p.get("crc32c"), 0, 2**32 - 1) and p.get("file") in names
                for p in parts) for n, parts in pieces.items())):
        return ["pieces: expected {tensor: [{start, stop, crc32c, file}]} naming the index's files"]
    return []


def read_folder(folder: Path, op: str, wanted: Optional[Callable] = None):
    """``(manifest, tensors, checked)`` of a sharded checkpoint, as ``read_checked`` gives
    a file's: every file and piece verified, the pieces put together.

    ``wanted(checked)``, asked once the manifest is read, gives ``None`` (read everything)
    or a function ``name -> None or [(start, stop), ...]``: the element ranges of a pieced
    tensor this reader needs (a resuming rank's own ranges, ``parallel/sharding/resume.py``),
    ``None`` for all of it. Each tensor given ranges is then memory the
    operating system backs only where written (``torch.empty``), with only those ranges read
    into it from the files (``pread``, no mapping), and only the pieces they overlap
    verified (read through one buffer); a pieced tensor given ``None`` is read
    whole. The manifest lists those tensors under ``"ranged"`` (their whole checksums are
    not computed: ``None``)."""
    index = read_index(folder, op)
    manifest, checked = manifest_of(index.get("manifest"), op, folder)
    files = index["files"]
    problems = []
    names = {f["name"] for f in files}
    for entry in os.scandir(folder):
        m = SHARD.fullmatch(entry.name)
        if entry.name == INDEX or entry.name in names or (m and m.group(1) != index.get("generation")):
            continue
        if SCRATCH.fullmatch(entry.name) or MARKER.fullmatch(entry.name):
            continue  # a writer's scratch or in-flight marker (removed by the next save)
        problems.append(f"stray file {entry.name!r} (the index does not name it)")
    for f in files:
        p = folder / f["name"]
        if p.is_symlink():
            problems.append(f"file {f['name']!r} is a symbolic link (a checkpoint's files are its own)")
        elif not p.is_file():
            problems.append(f"missing file {f['name']!r} (rank {f['rank']})")
        elif p.stat().st_size != f["bytes"]:
            problems.append(f"file {f['name']!r} is {p.stat().st_size} bytes, the index says {f['bytes']}")
    raise_all(op, folder, problems)
    ranges_of = wanted(checked) if wanted is not None else None
    with contextlib.ExitStack() as stack:
        opened = {f["name"]: stack.enter_context(TensorFile(folder / f["name"], op)) for f in files}
        entries = {key: (name, e) for name, tf in opened.items() for key, e in tf.entries.items()}
        want = expected_tensors(manifest)
        tensors: dict = {}
        pieces = index.get("pieces", {})
        ranged = {n: r for n in pieces if ranges_of is not None and (r := ranges_of(n)) is not None}
        stored = {}  # views of the files' private mappings (valid after close): what is read whole
        for key, (name, _) in entries.items():
            if "@" not in key:
                tensors[key] = opened[name].read(key)
            elif key.rpartition("@")[0] not in ranged:
                stored[key] = opened[name].read(key)
        for name, parts in pieces.items():
            if name in ranged:
                whole = _ranged(name, parts, opened, entries, want, ranged[name], problems)
            else:
                whole = _assembled(name, parts, stored, entries, want, problems)
            if whole is not None:
                tensors[name] = whole
    listed = {piece_key(n, p.get("start")) for n, parts in pieces.items() for p in parts}
    problems += [f"unexpected piece {key!r} (the index does not name it)" for key in entries
                 if "@" in key and key not in listed]
    for name in sorted(set(tensors) & set(manifest["checksums"])):
        if checksum(tensors[name], manifest["version"]) != manifest["checksums"][name]:
            problems.append(f"tensor {name!r} fails its checksum (the file is corrupt)")
    raise_all(op, folder, problems)
    manifest = dict(manifest, checksums=dict(manifest["checksums"], **{
        n: None if n in ranged else checksum(tensors[n], manifest["version"]) for n in pieces}), ranged=sorted(ranged))
    problems = tensor_list_problems(manifest, want, {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()})
    raise_all(op, folder, problems)
    return manifest, tensors, checked


def _tiled(name: str, parts: list, entries: dict, want: dict, problems: list) -> Optional[tuple]:
    """``(dtype, shape, numel, parts in order)`` when the pieces of ``name`` (their
    headers: nothing read) tile it exactly, each of the dtype and length it must have."""
    if name not in want:
        problems.append(f"unexpected tensor {name!r} (the manifest does not describe it)")
        return None
    dtype, shape = want[name]
    numel = 1
    for d in shape or ():
        numel *= d
    at, ordered = 0, sorted(parts, key=lambda x: x["start"])
    for p in ordered:
        found = entries.get(piece_key(name, p["start"]))
        if p["start"] != at:
            problems.append(f"tensor {name!r}: pieces leave a gap or overlap at element {at} "
                            f"(the next piece starts at {p['start']})")
            return None
        e = found[1] if found is not None and found[0] == p["file"] else None
        if e is None or e.dtype != dtype or len(e.shape) != 1 or e.shape[0] != p["stop"] - at:
            problems.append(f"tensor {name!r}: piece [{at}, {p['stop']}) is missing or of the wrong size or dtype "
                            f"in {p['file']!r}")
            return None
        at = p["stop"]
    if at != numel:
        problems.append(f"tensor {name!r}: its pieces cover {at} of its {numel} elements")
        return None
    return dtype, shape, numel, ordered


def _ranged(name: str, parts: list, opened: dict, entries: dict, want: dict, ranges: list,
            problems: list) -> Optional[torch.Tensor]:
    """Tensor ``name`` with only ``ranges`` read in (see ``read_folder``)."""
    tiled = _tiled(name, parts, entries, want, problems)
    if tiled is None:
        return None
    dtype, shape, numel, ordered = tiled
    flat = torch.empty(numel, dtype=dtype)  # backed only where a range is read in
    for p in ordered:
        spans = [(max(lo, p["start"]), min(hi, p["stop"])) for lo, hi in ranges if lo < p["stop"] and hi > p["start"]]
        if not spans:
            continue
        tf, key = opened[p["file"]], piece_key(name, p["start"])
        if tf.crc32c_of(key) != p["crc32c"]:
            problems.append(f"tensor {name!r}: piece [{p['start']}, {p['stop']}) in {p['file']!r} fails its "
                            f"checksum (the file is corrupt)")
            return None
        for lo, hi in spans:
            tf.read_into(key, lo - p["start"], hi - p["start"], flat[lo:hi])
    flat = flat.view(shape) if shape is not None else flat
    flat._read_in_part = True  # noqa: SLF001 (``read_in_part``: a reader's slices of it need no copy)
    return flat


def read_in_part(t) -> bool:
    """Whether ``t`` was read in part (``wanted``): memory backed only where its reader's
    ranges were read, so a slice of those ranges is as small as a copy of it, and kept
    as it is (a copy would hold those bytes twice)."""
    return getattr(t, "_read_in_part", False)


def _assembled(name: str, parts: list, stored: dict, entries: dict, want: dict, problems: list
               ) -> Optional[torch.Tensor]:
    """One tensor from its pieces, which must tile it and pass their checksums."""
    tiled = _tiled(name, parts, entries, want, problems)  # every piece checked before anything is allocated
    if tiled is None:
        return None
    dtype, shape, numel, ordered = tiled
    for p in ordered:
        if checksum(stored[piece_key(name, p["start"])]) != p["crc32c"]:
            problems.append(f"tensor {name!r}: piece [{p['start']}, {p['stop']}) in {p['file']!r} fails its "
                            f"checksum (the file is corrupt)")
            return None
    flat = torch.empty(numel, dtype=dtype)
    for p in ordered:
        flat[p["start"]: p["stop"]] = stored[piece_key(name, p["start"])]
    return flat.view(shape) if shape is not None else flat


def describe_folder(folder: Path) -> str:
    """One line on a sharded folder: its ranks, files and bytes."""
    index = read_index(folder, "inspect")
    size = sum(f["bytes"] for f in index["files"]) + (folder / INDEX).stat().st_size
    return f"sharded over {index['world']} rank(s): {len(index['files'])} files and {INDEX}, {size:,} bytes"
