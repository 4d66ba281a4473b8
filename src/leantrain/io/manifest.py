"""The checkpoint manifest's schema: every field's type and range, checked before use.

A manifest passes its CRC when it was written by leantrain *or* edited and resealed,
so its structure is checked like any outside input: ``manifest_problems`` lists
every field of the wrong type or out of range (without recursion, whatever the
nesting), and ``expected_tensors`` then says which tensors, of which dtype and
shape, the file must hold, so strays are rejected from the header alone.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .nested import references
from ..optim import rules as R
from ..optim.optimizer import GENERIC, NATIVE
from ..params.schema import ParameterSchema
from ..validate import is_int, is_number

MAX_INT = 2**63 - 1
MAX_CUDA_DEVICES = 1024
LOADER_KINDS = ("sampled", "stateful", "iterable", "replay")  # training/loops/streams.py
LOADER_NAME = re.compile(r"[A-Za-z0-9_.]{1,200}")
DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


def _count(x: object, low: int = 0) -> bool:
    return is_int(x) and low <= x <= MAX_INT


def _finite(x: object, low: float = -math.inf, high: float = math.inf) -> bool:
    return is_number(x) and math.isfinite(x) and low <= x <= high


@dataclass(frozen=True)
class Checked:
    """A manifest's check: its problems (empty when sound), and what the check built on
    the way, for the loader to use instead of building it again: the slot schema and the
    optimizer's hyperparameters (``None`` when the file has no optimizer state)."""

    problems: list
    schema: Optional[ParameterSchema] = None
    hyper: Any = None


def manifest_problems(m: dict) -> list[str]:
    """Every way the manifest's structure, types or ranges are wrong (empty when sound)."""
    return check_manifest(m).problems


def check_manifest(m: dict) -> Checked:
    """``manifest_problems`` with the schema and hyperparameters it built."""
    out: list[str] = []
    slots = m.get("slots")
    if not isinstance(slots, list):
        return Checked(["slots: expected a list of slot entries"])
    next_storage = 0
    by_storage: dict[int, tuple] = {}
    for i, s in enumerate(slots):
        where = f"slots[{i}]"
        if not isinstance(s, dict):
            out.append(f"{where}: expected an object")
            continue
        name, shape, dtype, flag, k = (s.get(key) for key in ("name", "shape", "dtype", "requires_grad", "storage"))
        if name is not None and not isinstance(name, str):
            out.append(f"{where}.name: expected a string or null, got {name!r}")
        if not (isinstance(shape, list) and len(shape) <= 64 and all(_count(d) for d in shape)):
            out.append(f"{where}.shape: expected a list of sizes, got {shape!r}")
        if not _one_of(dtype, DTYPE_NAMES):
            out.append(f"{where}.dtype: expected one of {sorted(DTYPE_NAMES)}, got {dtype!r}")
        if not isinstance(flag, bool):
            out.append(f"{where}.requires_grad: expected true or false, got {flag!r}")
        if not (_count(k) and k <= next_storage):
            out.append(f"{where}.storage: expected a storage number <= {next_storage} (first use in order), "
                       f"got {k!r}")
            continue
        next_storage = max(next_storage, k + 1)
        seen = by_storage.setdefault(k, (shape, dtype))
        if seen != (shape, dtype):
            out.append(f"{where}: shares storage {k} with another shape or dtype ({shape!r} {dtype!r} vs "
                       f"{seen[0]!r} {seen[1]!r})")
    reps = m.get("representatives")
    if not (isinstance(reps, list) and len(reps) == len(slots) and all(r is None or _count(r) for r in reps)):
        out.append(f"representatives: expected one slot number or null per slot, got {_short(reps)}")
    if out:
        return Checked(out)
    schema = ParameterSchema.from_manifest(slots, reps)
    out += [f"representatives: {p}" for p in schema.problems()]
    opt_problems, hyper = _optimizer_problems(m.get("optimizer"), schema)
    out += opt_problems
    if not isinstance(m.get("progress", {}), dict):
        out.append(f"progress: expected an object, got {_short(m.get('progress'))}")
    out += _loader_problems(m.get("loader"))
    out += _averaged_problems(m.get("averaged"))
    ema = m.get("ema")
    if ema is not None:
        n = next_storage
        ks = ema.get("storages") if isinstance(ema, dict) else None
        if not (isinstance(ema, dict) and _finite(ema.get("decay"), 0.0, 1.0) and ema["decay"] < 1.0
                and _count(ema.get("count")) and isinstance(ks, list) and all(_count(k) and k < n for k in ks)
                and ks == sorted(set(ks))):
            out.append(f"ema: expected {{decay in [0, 1), count, storages: increasing storage numbers < {n}}}, "
                       f"got {_short(ema)}")
        elif not out:  # the storages averaged: none before the first update, every trainable one after
            trained = sorted({s["storage"] for s, r in zip(slots, m.get("representatives", [])) if r is not None})
            want = [] if ema["count"] == 0 else trained
            if ks != want:
                out.append(f"ema: after {ema['count']} update(s) the averages are of storages {want}, "
                           f"the record lists {ks}")
    identity = m.get("identity")
    if identity is not None and not (isinstance(identity, dict) and set(identity) == {"run", "file"}
                                     and all(isinstance(v, str) and len(v) <= 64 for v in identity.values())):
        out.append(f"identity: expected {{run: id, file: id}}, got {_short(identity)}")
    if m.get("model_config") is not None and not _json_object_text(m["model_config"]):
        out.append(f"model_config: expected a model config's JSON text, got {_short(m['model_config'])}")
    rng = m.get("rng")
    if not (isinstance(rng, dict) and isinstance(rng.get("torch"), bool)
            and _count(rng.get("cuda")) and rng["cuda"] <= MAX_CUDA_DEVICES):
        out.append(f"rng: expected {{torch: true/false, cuda: device count}}, got {_short(rng)}")
    elif not _py_numpy_rng_ok(rng):
        out.append(f"rng: python/numpy states malformed, got {_short(rng)}")
    sums = m.get("checksums")
    if not (isinstance(sums, dict) and all(is_int(v) and 0 <= v < 2**32 for v in sums.values())):
        out.append("checksums: expected a map of tensor names to 32-bit checksums")
    return Checked(out, schema, hyper)


def _optimizer_problems(entry: object, schema: ParameterSchema) -> tuple[list[str], Any]:
    """(problems, the hyperparameter record built from the entry, or ``None``)."""
    if entry is None:
        return [], None
    if not isinstance(entry, dict):
        return [f"optimizer: expected an object or null, got {_short(entry)}"], None
    out, built = [], None
    kind = entry.get("kind")
    if not _one_of(kind, R.HYPERS):
        return [f"optimizer.kind: expected one of {sorted(R.HYPERS)}, got {_short(kind)}"], None
    hyper = entry.get("hyper")
    if not (isinstance(hyper, dict) and all(v is None or isinstance(v, (int, float, str)) for v in hyper.values())):
        out.append(f"optimizer.hyper: expected a map of numbers, got {_short(hyper)}")
    else:
        try:
            built = R.HYPERS[kind](**hyper)
        except Exception as e:  # the record's own check says what is wrong
            out.append(f"optimizer.hyper: {e}")
    if not _finite(entry.get("lr"), 0.0):
        out.append(f"optimizer.lr: expected a finite number >= 0, got {_short(entry.get('lr'))}")
    if not _one_of(entry.get("path"), (GENERIC, NATIVE)):
        out.append(f"optimizer.path: expected {GENERIC!r} or {NATIVE!r}, got {_short(entry.get('path'))}")
    if not _count(entry.get("steps")):
        out.append(f"optimizer.steps: expected an integer in [0, 2**63), got {_short(entry.get('steps'))}")
    per_slot = entry.get("per_slot", [])
    if not (isinstance(per_slot, list) and all(
            isinstance(x, list) and len(x) == 2 and _count(x[0]) and schema.is_representative(x[0])
            and isinstance(x[1], dict) and x[1] and all(isinstance(k, str) and (_finite(v) or isinstance(v, bool))
                                                        for k, v in x[1].items())
            for x in per_slot) and [x[0] for x in per_slot] == sorted({x[0] for x in per_slot})):
        out.append(f"optimizer.per_slot: expected increasing [slot, {{name: number}}] pairs, got {_short(per_slot)}")
    for name, high in (("lrs", math.inf), ("bases", math.inf), ("momenta", 1.0)):
        values = entry.get(name, [])
        if not (isinstance(values, list) and len(values) <= 2**16 and all(_finite(v, 0.0, high) for v in values)):
            out.append(f"optimizer.{name}: expected a list of finite numbers >= 0, got {_short(values)}")
    records = entry.get("records")
    if not isinstance(records, dict):
        return out + [f"optimizer.records: expected an object, got {_short(records)}"], built
    for key, rec in records.items():
        where = f"optimizer.records[{key!r}]"
        if not (key.isdigit() and len(key) < 19 and schema.is_representative(int(key))):
            out.append(f"{where}: not a slot that owns an optimizer history")
            continue
        if not (isinstance(rec, dict) and _one_of(rec.get("type"), R.RECORDS)
                and isinstance(rec.get("scalars"), dict) and isinstance(rec.get("tensors"), list)
                and all(isinstance(t, str) for t in rec["tensors"])):
            out.append(f"{where}: expected {{type, scalars, tensors}}, got {_short(rec)}")
            continue
        out += [f"{where}.scalars: {p}" for p in R.scalar_problems(rec["type"], rec["scalars"])]
    return out, built


def expected_tensors(m: dict) -> dict[str, tuple[torch.dtype, Optional[tuple[int, ...]]]]:
    """Each tensor a sound manifest implies: name -> (dtype, shape; ``None``: any 1-D)."""
    want: dict[str, tuple[torch.dtype, Optional[tuple[int, ...]]]] = {}
    slots = m["slots"]
    storage: dict[int, tuple] = {}  # storage number -> (dtype, shape) of its first slot
    for s in slots:
        storage.setdefault(s["storage"], (DTYPE_NAMES[s["dtype"]], tuple(s["shape"])))
    for k, entry in storage.items():
        want[f"storage.{k}"] = entry
    opt = m.get("optimizer")
    if opt:
        for key, rec in opt["records"].items():
            s = slots[int(key)]
            kind = R.RECORDS[rec["type"]]
            for name in rec["tensors"]:
                want[f"state.{key}.{name}"] = (DTYPE_NAMES[s["dtype"]], R.state_shape(kind, name, tuple(s["shape"])))
    loader = m.get("loader")
    if loader is not None and "kind" in loader:
        for name, spec in loader.get("tensors", {}).items():
            want[f"loader.{name}"] = (DTYPE_NAMES[spec["dtype"]], tuple(spec["shape"]))
    elif loader is not None:
        want["loader.order"] = (torch.int64, None)
    if m.get("ema") is not None:
        for k in m["ema"]["storages"]:
            want[f"ema.{k}"] = storage[k]
    for name, spec in (m.get("averaged") or {}).items():
        want[f"averaged.{name}"] = (DTYPE_NAMES[spec["dtype"]], tuple(spec["shape"]))
    if m["rng"]["torch"]:
        want["rng.torch"] = (torch.uint8, tuple(torch.get_rng_state().shape))
    for d in range(m["rng"]["cuda"]):
        want[f"rng.cuda.{d}"] = (torch.uint8, None)
    if "python" in m["rng"]:
        want["rng.python"] = (torch.int64, (625,))
    if "numpy" in m["rng"]:
        want["rng.numpy"] = (torch.int64, (624,))
    return want


def _loader_problems(loader: object) -> list[str]:
    """A loader record: a leantrain DataLoader's (no ``kind``) or a stream's position: a
    kind, JSON fields, and named tensors each with a known dtype and shape, every tensor
    the stored state refers to among them."""
    if loader is None:
        return []
    if not isinstance(loader, dict):
        return [f"loader: expected an object or null, got {_short(loader)}"]
    if "kind" not in loader:
        return []
    if not _one_of(loader["kind"], LOADER_KINDS):
        return [f"loader.kind: expected one of {sorted(LOADER_KINDS)}, got {_short(loader['kind'])}"]
    named = loader.get("tensors", {})
    if not (isinstance(named, dict) and all(
            isinstance(k, str) and LOADER_NAME.fullmatch(k) and isinstance(v, dict) and set(v) == {"dtype", "shape"}
            and _one_of(v["dtype"], DTYPE_NAMES) and isinstance(v["shape"], list) and all(_count(d) for d in v["shape"])
            for k, v in named.items())):
        return [f"loader.tensors: expected names ([A-Za-z0-9_.]) with a dtype and a shape, got {_short(named)}"]
    missing = sorted(references(loader.get("state")) - set(named))
    if missing:
        return [f"loader.state: refers to tensors the record does not list: {missing[:3]}"]
    return []


def check_json(op: str, what: str, value: Any) -> Optional[str]:
    """Why ``value`` cannot be stored as JSON (``None`` when it can)."""
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError, RecursionError) as e:
        return f"{op}: {what} must be JSON data (dicts, lists, strings, numbers), {e}"
    return None


def _json_object_text(x: object) -> bool:
    """Whether ``x`` is the text of one JSON object (a config.json)."""
    if not isinstance(x, str) or len(x) > 2**22:
        return False
    try:
        return isinstance(json.loads(x), dict)
    except (ValueError, RecursionError):
        return False


def _one_of(x: object, choices) -> bool:
    return isinstance(x, str) and x in choices


def _short(x: object) -> str:
    try:
        text = repr(x)
    except RecursionError:
        return f"a {type(x).__name__} nested too deep"
    return text if len(text) <= 80 else text[:77] + "..."


def _py_numpy_rng_ok(rng: dict) -> bool:
    """Python's and NumPy's generator scalars, where saved (older checkpoints have neither)."""
    py, np_ = rng.get("python"), rng.get("numpy")
    if py is not None and not (isinstance(py, dict) and isinstance(py.get("version"), int)
                               and (py.get("gauss") is None or isinstance(py.get("gauss"), (int, float)))):
        return False
    if np_ is not None and not (isinstance(np_, dict) and isinstance(np_.get("pos"), int)
                                and 0 <= np_["pos"] <= 624 and np_.get("has_gauss") in (0, 1)
                                and isinstance(np_.get("gauss"), (int, float))):
        return False
    return True


def _averaged_problems(averaged: object) -> list[str]:
    """A torch AveragedModel's state entry: names to known dtypes and shapes."""
    if averaged is None:
        return []
    ok = isinstance(averaged, dict) and all(
        isinstance(name, str) and isinstance(spec, dict) and spec.get("dtype") in DTYPE_NAMES
        and isinstance(spec.get("shape"), list) and all(_count(d) for d in spec["shape"])
        for name, spec in averaged.items())
    return [] if ok else [f"averaged: expected {{name: {{dtype, shape}}}}, got {_short(averaged)}"]
