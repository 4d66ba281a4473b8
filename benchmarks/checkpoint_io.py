"""Save and load of a ~1 GiB parameter pack: leantrain checkpoints vs torch.save/torch.load
and plain safetensors save_file/load_file. Same tensors, same folder, interleaved runs;
prints the median seconds and the ratios (leantrain / other).

leantrain does more per call: a CRC-32 of every tensor, fsync of file and folder, an
atomic rename, and on load a full validation before installing the values. Every load
ends with the values copied into the destination parameters (safetensors' load_file
alone only maps the file; nothing is read until the copy).

Run: .venv/bin/python benchmarks/checkpoint_io.py [--gib 1.0] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from safetensors.torch import load_file, save_file

import leantrain as lt


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--runs", type=int, default=11)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    numel = int(args.gib * 2**30 / 4 / args.tensors)
    gen = torch.Generator().manual_seed(0)
    pack = [torch.randn(numel, generator=gen) for _ in range(args.tensors)]
    params = lt.ParamList.of_pack(pack)
    named = {f"t{i}": t for i, t in enumerate(pack)}
    folder = tempfile.mkdtemp(dir=args.dir)
    paths = {k: os.path.join(folder, k) for k in ("lt", "st", "sf", "pt")}
    dest = lt.ParamList.of_pack([torch.empty(numel) for _ in range(args.tensors)])

    def install(loaded: dict) -> None:
        with torch.no_grad():
            for i, t in enumerate(dest):
                t.storage.host.copy_(loaded[f"t{i}"])

    def save_file_fsync() -> None:  # plain safetensors made durable the way leantrain is
        save_file(named, paths["sf"])
        fd = os.open(paths["sf"], os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    ops = {
        "save leantrain": lambda: lt.save_checkpoint(paths["lt"], params, rng=False),
        "save safetensors": lambda: save_file(named, paths["st"]),
        "save st + fsync": save_file_fsync,
        "save torch.save": lambda: torch.save(named, paths["pt"]),
        "load leantrain": lambda: lt.load_checkpoint(paths["lt"], dest),
        # a load is only done once the values sit in the destination tensors: the plain
        # loaders return (lazily mapped) tensors, so both baselines also copy them in
        "load safetensors": lambda: install(load_file(paths["st"])),
        "load torch.load": lambda: install(torch.load(paths["pt"])),
    }
    times: dict[str, list[float]] = {k: [] for k in ops}
    for r in range(args.runs):
        order = list(ops) if r % 2 == 0 else list(reversed(list(ops)))
        for phase in ("save", "load"):
            for name in order:
                if name.startswith(phase):
                    times[name].append(timed(ops[name]))
    med = {k: statistics.median(v) for k, v in times.items()}
    size = os.path.getsize(paths["lt"]) / 2**30
    print(f"pack: {args.tensors} tensors, {size:.2f} GiB on disk, {args.runs} interleaved runs, folder {folder}")
    for k, v in med.items():
        print(f"  {k:<18} {v:7.3f} s")
    for phase in ("save", "load"):
        ours = med[f"{phase} leantrain"]
        print(
            f"  {phase}: leantrain/safetensors = {ours / med[f'{phase} safetensors']:.2f}x, "
            f"leantrain/torch = {ours / med[f'{phase} torch.' + phase]:.2f}x"
        )
    print(f"  save: leantrain/(safetensors + fsync) = {med['save leantrain'] / med['save st + fsync']:.2f}x")
    for ours, other in (("save leantrain", "save st + fsync"), ("load leantrain", "load safetensors")):
        ratios = [a / b for a, b in zip(times[ours], times[other])]  # per run: the two ran back to back
        print(f"  {ours} / {other}: per-run ratio best {min(ratios):.2f}, median {statistics.median(ratios):.2f}")
    for p in paths.values():
        os.remove(p)
    os.rmdir(folder)


if __name__ == "__main__":
    main()
