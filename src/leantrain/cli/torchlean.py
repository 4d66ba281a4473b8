"""``leantrain export --torchlean`` and ``leantrain inspect`` for TorchLean's own files."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Optional

from ..errors import CheckpointError
from ..io import torchlean
from ..io.bits import read_json
from ..io.framing import U64, ByteReader
from ..io.checkpoint import load_checkpoint, optimizer_of, params_from_checkpoint, read_checkpoint
from ..io.weights import save_weights
from .usage import UserError


def cmd_export(args) -> int:
    """``--weights``: a safetensors weights file at ``-o FILE``. ``--torchlean``: the
    parameters as the ``TLPF32B`` stream at ``-o FILE``; Adam/AdamW state, when the
    checkpoint has some, as ``TLADAMF`` at ``FILE.adam``. ``--ema``: the checkpoint's
    moving average of the weights instead of the trained values."""
    src, out = Path(args.checkpoint), Path(args.output)
    if src.is_dir() and (src / "checkpoint.ckpt").is_file():
        src = src / "checkpoint.ckpt"  # a run folder: its checkpoint
    if out.is_dir():
        raise UserError(f"export: -o {out}: is a folder; give a file name")
    if args.weights == args.torchlean:
        raise UserError("export: choose the format: --weights (safetensors) or --torchlean")
    adam = out.with_name(out.name + ".adam")
    for target in (out, adam) if args.torchlean else (out,):
        if src.exists() and target.exists() and src.samefile(target):
            raise UserError(f"export: -o {out} would write over the checkpoint being exported ({src}); "
                            f"give another file name")
    what = "moving average" if args.ema else "weights"
    params = params_from_checkpoint(src, "export", ema=args.ema)
    if args.weights:
        save_weights(out, params)
        print(f"wrote {out} (safetensors, {len(params)} slots, the {what})")
        return 0
    # Everything decided before the first file is written: nothing is left half-exported.
    state, why_not = None, _adam_refusal(src, args.ema)
    if why_not is None:
        state = load_checkpoint(src, params_from_checkpoint(src, "export"), optimizer=optimizer_of(
            read_checkpoint(src, "export")[0]), restore_rng=False).state
        why_not = _state_refusal(state, params)
    torchlean.write_torchlean_f32(out, params)
    print(f"wrote {out} (TLPF32B v2, {len(params)} slots, the {what})")
    if why_not is None:
        torchlean.write_torchlean_adam(adam, params, state)
        print(f"wrote {adam} (TLADAMF, {state.hyper.kind}, step {state.steps})")
        return 0
    if why_not:
        print(f"optimizer state not exported: {why_not}")
    if adam.exists():
        adam.unlink()  # an earlier export's state beside the new parameters would not belong to them
        print(f"removed {adam}: it held an earlier export's optimizer state")
    return 0


def _adam_refusal(src: Path, ema: bool) -> Optional[str]:
    """Why the checkpoint's optimizer state cannot be a TLADAMF file, from its manifest
    (``""``: it has none; ``None``: it can be)."""
    if ema:
        return "it belongs to the trained weights, not their average"
    entry = read_checkpoint(src, "export")[0].get("optimizer")
    if not entry:
        return ""
    if entry["kind"] not in ("adam", "adamw"):
        return f"TorchLean's optimizer file holds Adam/AdamW, this is {entry['kind']}"
    if entry.get("per_slot"):
        return "it has per-slot hyperparameters, and TorchLean's optimizer file holds one set"
    if entry["steps"] == 0:
        return "no update has been made yet"
    return None


def _state_refusal(state, params) -> Optional[str]:
    """Why a loaded Adam state cannot be written (a slot that never had a gradient)."""
    for i, c in enumerate(params.canonical_slot_indices()):
        if c == i and state.slots[i].step == 0:
            return f"{params.label(i)} never had a gradient, and TorchLean's file needs every slot's moments"
    return None


def inspect_torchlean(path: Path, fmt: str) -> None:
    """Print a TorchLean file's structure, after checking it parses to its end."""
    size = path.stat().st_size
    if fmt == "TLPF32B":
        r = ByteReader(path.read_bytes(), f"inspect: {path}")
        r.take(7)
        version, count = r.u64(), r.u64()
        print(f"{path}: TorchLean float32 parameter stream (TLPF32B) v{version}, {size:,} bytes, {count} slots")
        for i in range(count):
            dims, n = r.shape()
            r.take(4 * n)
            print(f"{i:>4}  shape {dims}  ({n} values)")
    elif fmt == "TLADAMF":
        r = ByteReader(path.read_bytes(), f"inspect: {path}")
        r.take(7)
        version, tag = r.u64(), r.u64()
        b1, b2, eps, wd = (struct.unpack("<d", U64.pack(r.u64()))[0] for _ in range(4))
        counter = r.u64() if version == 4 else None
        kind = {0: "adam", 1: "adamw"}.get(tag, f"unknown tag {tag}")
        print(f"{path}: TorchLean Adam/AdamW optimizer state (TLADAMF) v{version}, {size:,} bytes")
        print(f"optimizer: {kind}(beta1={b1!r}, beta2={b2!r}, eps={eps!r}, weight_decay={wd!r}), "
              f"random counter: {'none (legacy)' if counter is None else counter}")
        count = r.u64()
        flags = []
        for i in range(count):
            dims, n = r.shape()
            flags.append(r.u64())
            print(f"{i:>4}  shape {dims}  trainable {'yes' if flags[-1] else 'no'}")
        if version >= 3:
            tags = [r.u64() for _ in range(count)]
            print("alias map: " + ", ".join("-" if t == 0 else str(t - 1) for t in tags))
        entries = r.u64()
        for _ in range(entries):
            i, t, n = r.u64(), r.u64(), r.u64()
            r.take(8 * n)
            print(f"history of slot {i}: t = {t}, {n} values")
    else:
        doc = read_json(f"inspect: {path}", path)
        records = doc.get("params", []) if isinstance(doc, dict) else []
        print(f"{path}: TorchLean JSON ({fmt}), {size:,} bytes, {len(records)} slots")
        for i, rec in enumerate(records):
            shape = rec.get("shape") if isinstance(rec, dict) else None
            print(f"{i:>4}  shape {tuple(shape) if isinstance(shape, list) else shape!r}")
        return
    if r.trailing():
        raise CheckpointError(f"inspect: {path}: {r.trailing()} trailing bytes")
    print("structure: OK (parsed to the last byte)")
