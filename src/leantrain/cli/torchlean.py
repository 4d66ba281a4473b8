"""``leantrain export --torchlean`` and ``leantrain inspect`` for TorchLean's own files."""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Optional

from ..errors import CheckpointError, ConfigError
from ..optim.hyper import Adam, AdamW
from ..io import torchlean
from ..io.regular import read_json, read_regular
from ..io.torchlean.framing import U64, ByteReader
from ..io.checkpoint import read_checkpoint
from ..io.dcp_export import export_dcp
from ..io.loading import load_checkpoint
from ..io.exporting import consolidate, optimizer_of, params_from_checkpoint
from ..io.weights import save_weights
from .managed import run_checkpoint
from .run_folder import is_run_folder
from .usage import UserError


def _inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` lies inside ``folder`` (a sharded checkpoint's own files)."""
    if not folder.is_dir():
        return False
    try:
        return path.resolve().is_relative_to(folder.resolve())
    except (OSError, RuntimeError):
        return False


def cmd_export(args) -> int:
    """``--consolidate``: a sharded checkpoint folder as one checkpoint file. ``--weights``:
    a safetensors weights file at ``-o FILE``, or, for a Hugging Face model (its config
    kept in the checkpoint, or given with ``--config``), a folder ``from_pretrained``
    loads. ``--torchlean``: the parameters as the ``TLPF32B`` stream at ``-o FILE``;
    Adam/AdamW state, when the checkpoint has some, as ``TLADAMF`` at ``FILE.adam``.
    ``--dcp``: a ``torch.distributed.checkpoint`` folder at ``-o DIR`` (``io/dcp_export.py``).
    ``--ema``: the checkpoint's moving average of the weights instead of the trained
    values. A run folder exports its checkpoint: its single file, or of a run keeping a
    folder of checkpoints the best (``--keep-best``), else the newest, or ``--step N``.
    Export is a data operation: it imports and calls nothing a file names."""
    if args.weights + args.torchlean + args.consolidate + args.dcp != 1:
        raise UserError("export: choose the format: --weights (safetensors), --torchlean, --consolidate or --dcp")
    src, out = run_checkpoint(Path(args.checkpoint), args.step), Path(args.output)
    if args.dcp:
        if args.config is not None:
            raise UserError("export: --config gives a Hugging Face config.json for --weights; drop it")
        export_dcp(src, out, args.ema)
        print(f"wrote {out} (torch.distributed.checkpoint, the {'moving average' if args.ema else 'weights'}; "
              f"torch.distributed.checkpoint.load(model.state_dict(), checkpoint_id=...) reads it)")
        return 0
    if args.config is not None and not args.weights:
        raise UserError("export: --config gives a Hugging Face config.json for --weights; drop it")
    hf = _model_config(src, args.config) if args.weights else None
    as_file = hf is not None and out.suffix == ".safetensors"  # a file, its config.json beside it
    if as_file and out.is_dir():
        raise UserError(f"export: -o {out}: is a folder; a path ending in .safetensors names the weights file")
    if hf is not None and not as_file:
        if out.exists() and not out.is_dir():
            raise UserError(f"export: -o {out}: is a file; a Hugging Face run exports a folder from_pretrained loads "
                            f"(or give a path ending in .safetensors: the file, config.json beside it)")
    elif hf is None and out.is_dir():
        raise UserError(f"export: -o {out}: is a folder; give a file name")
    if hf is not None:
        folder = out.parent if as_file else out
        if is_run_folder(folder):  # its config.json is the run's: resume reads it
            raise UserError(f"export: -o {out}: {folder} is a leantrain run folder, whose config.json is the run's "
                            f"settings (train --resume reads it); the model's config.json would replace it: give "
                            f"a folder outside the run")
    if args.consolidate:
        if args.ema:
            raise UserError("export: --consolidate writes the whole checkpoint (its moving average included); "
                            "drop --ema")
        if src.exists() and out.exists() and src.samefile(out) or _inside(out, src):
            raise UserError(f"export: -o {out} would write over the checkpoint being exported ({src}); give a name "
                            f"outside it")
        consolidate(src, out)
        print(f"wrote {out} (one checkpoint file)")
        return 0
    adam = out.with_name(out.name + ".adam")
    for target in (out, adam) if args.torchlean else (out,):
        if src.exists() and target.exists() and src.samefile(target) or _inside(target, src):
            raise UserError(f"export: -o {out} would write over the checkpoint being exported ({src}); "
                            f"give another file name")
    what = "moving average" if args.ema else "weights"
    params = params_from_checkpoint(src, "export", ema=args.ema)
    if args.weights and hf is not None and as_file:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_weights(out.parent, params, pretrained=True, config=hf, name=out.name)
        loads = "from_pretrained loads the folder" if out.name == "model.safetensors" else \
            "from_pretrained loads the folder once the file is named model.safetensors"
        print(f"wrote {out} and {out.parent / 'config.json'} beside it (the {what}; {loads})")
        return 0
    if args.weights and hf is not None:
        out.mkdir(parents=True, exist_ok=True)
        save_weights(out, params, pretrained=True, config=hf)
        print(f"wrote {out}/model.safetensors and {out}/config.json (the {what}; from_pretrained loads the folder)")
        return 0
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


def _model_config(src: Path, given: Optional[str]) -> Optional[str]:
    """The Hugging Face config.json text an export writes beside the weights: the file
    ``--config`` names (a JSON object, read as data), else the one the checkpoint keeps
    (a run of a model with a ``config``), else ``None`` (a plain weights file)."""
    if given is not None:
        found = read_json("export --config", given)
        if not isinstance(found, dict):
            raise UserError(f"export: --config {given}: not a JSON object (a model's config.json)")
        return read_regular("export --config", given).decode()
    return read_checkpoint(src, "export")[0].get("model_config")


def _shape(r: ByteReader, op: str, i: int) -> tuple[tuple[int, ...], int]:
    """A slot's dims and element count, which must agree (as the readers require)."""
    dims, n = r.shape()
    if n != math.prod(dims):
        raise CheckpointError(f"{op}: slot {i}: element count {n} does not match the shape {dims}")
    return dims, n


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
    op = f"inspect: {path}"
    if fmt == "TLPF32B":
        r = ByteReader(read_regular("inspect", path), op)
        r.take(7)
        version, count = r.u64(), r.u64()
        if version != torchlean.VERSION_F32:  # the reader's checks that need no destination
            raise CheckpointError(f"{op}: unsupported format version {version}; expected {torchlean.VERSION_F32}")
        print(f"{path}: TorchLean float32 parameter stream (TLPF32B) v{version}, {size:,} bytes, {count} slots")
        for i in range(count):
            dims, n = _shape(r, op, i)
            r.take(4 * n)
            print(f"{i:>4}  shape {dims}  ({n} values)")
    elif fmt == "TLADAMF":
        r = ByteReader(read_regular("inspect", path), op)
        r.take(7)
        version, tag = r.u64(), r.u64()
        if version not in (2, 3, 4):
            raise CheckpointError(f"{op}: unsupported format version {version}; expected 2, 3 or 4")
        if tag not in (0, 1):
            raise CheckpointError(f"{op}: unknown optimizer kind tag {tag} (0 = Adam, 1 = AdamW)")
        b1, b2, eps, wd = (struct.unpack("<d", U64.pack(r.u64()))[0] for _ in range(4))
        try:  # the hyperparameters' own checks (a NaN beta is not a configuration)
            AdamW(1e-3, wd, b1, b2, eps) if tag == 1 else Adam(1e-3, b1, b2, eps)
        except ConfigError as e:
            raise CheckpointError(f"{op}: invalid optimizer config ({e})") from None
        counter = r.u64() if version == 4 else None
        kind = {0: "adam", 1: "adamw"}[tag]
        print(f"{path}: TorchLean Adam/AdamW optimizer state (TLADAMF) v{version}, {size:,} bytes")
        print(f"optimizer: {kind}(beta1={b1!r}, beta2={b2!r}, eps={eps!r}, weight_decay={wd!r}), "
              f"random counter: {'none (legacy)' if counter is None else counter}")
        count = r.u64()
        flags = []
        for i in range(count):
            dims, n = _shape(r, op, i)
            flags.append(r.u64())
            if flags[-1] not in (0, 1):
                raise CheckpointError(f"{op}: slot {i}: invalid `requiresGrad` flag {flags[-1]}")
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
        doc = read_json(op, path)
        records = doc.get("params", []) if isinstance(doc, dict) else None
        if not isinstance(records, list):
            raise CheckpointError(f"{op}: expected a JSON object whose 'params' is a list of records")
        print(f"{path}: TorchLean JSON ({fmt}), {size:,} bytes, {len(records)} slots")
        for i, rec in enumerate(records):
            shape = rec.get("shape") if isinstance(rec, dict) else None
            if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                    for d in shape)):
                raise CheckpointError(f"{op}: record {i}: expected a shape (a list of sizes), got {shape!r:.60}")
            print(f"{i:>4}  shape {tuple(shape)}")
        print("structure: OK (records and shapes; values are checked by the reader against a model)")
        return
    if r.trailing():
        raise CheckpointError(f"inspect: {path}: {r.trailing()} trailing bytes")
    print("structure: OK (parsed to the last byte)")
