"""``leantrain export --torchlean`` and ``leantrain inspect`` for TorchLean's own files."""

from __future__ import annotations

import struct
from pathlib import Path

from ..errors import CheckpointError
from ..io import torchlean
from ..io.bits import read_json
from ..io.framing import U64, ByteReader
from ..io.checkpoint import load_checkpoint, optimizer_of, params_from_checkpoint, read_checkpoint
from ..io.weights import save_weights
from ..optim.hyper import Adam, AdamW
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
    what = "moving average" if args.ema else "weights"
    if args.weights:
        params = params_from_checkpoint(src, "export", ema=args.ema)
        save_weights(out, params)
        print(f"wrote {out} (safetensors, {len(params)} slots, the {what})")
        return 0
    params = params_from_checkpoint(src, "export", ema=args.ema)
    manifest, _ = read_checkpoint(src, "export")
    torchlean.write_torchlean_f32(out, params)
    print(f"wrote {out} (TLPF32B v2, {len(params)} slots, the {what})")
    if args.ema:
        print("optimizer state not exported: it belongs to the trained weights, not their average")
        return 0
    opt = optimizer_of(manifest)
    ck = load_checkpoint(src, params_from_checkpoint(src, "export"), optimizer=opt, restore_rng=False)
    state = ck.state
    if state is not None and isinstance(state.hyper, (Adam, AdamW)) and state.steps > 0:
        adam = out.with_name(out.name + ".adam")
        torchlean.write_torchlean_adam(adam, params, state)
        print(f"wrote {adam} (TLADAMF, {state.hyper.kind}, step {state.steps})")
    elif state is not None:
        print(f"optimizer state not exported: TorchLean's optimizer file holds Adam/AdamW, this is {state.hyper.kind}")
    return 0


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
