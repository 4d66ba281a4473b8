"""TorchLean's Adam/AdamW optimizer-state file ``TLADAMF`` (spec §9.3), versions 2-4.

Layout (every integer a little-endian u64): the ASCII magic ``TLADAMF``; the version
(2: no aliases and no RNG counter; 3: the schema has aliases; 4: an RNG counter was
given, alias map included); the config as a kind tag (0 Adam, 1 AdamW) and the raw
binary64 bits of beta1, beta2, eps and weight decay; v4: the counter; the schema (slot
count, then per slot rank, dims, element count, trainable flag); v3/v4: per slot 0 for
frozen, else representative + 1; then the entry count and, by slot, id, ``t``, count,
``m`` and ``v`` as little-endian float32.

It carries leantrain's Adam/AdamW state (moments as float32; the learning rate is not
part of the file: the state takes the optimizer's). Reading checks everything listed
in the spec before returning anything.
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ...params.dense import to_layout
from ...errors import CheckpointError, ConfigError
from ...optim import OptState, Optimizer
from ...optim.hyper import Adam, AdamW
from ...optim.optimizer import GENERIC, NATIVE
from ...optim.rules import AdamState
from ...params.paramlist import params_of
from ..atomic import PathLike, atomic_write_bytes
from ..regular import read_regular
from .framing import U64, ByteReader, u64

MAGIC = b"TLADAMF"
F64 = struct.Struct("<d")
LEGACY_WARNING = "legacy checkpoint has no random counter; stochastic training cannot be resumed exactly"


@dataclass(frozen=True)
class AdamFile:
    """What ``read_torchlean_adam`` returns: the optimizer the file describes (with the
    destination's learning rate), its state for the destination, the version and the
    RNG counter (``None`` before version 4)."""

    optimizer: Optimizer
    state: OptState
    version: int
    counter: Optional[int]


def _u64(n: int) -> bytes:
    return u64(n, "write_torchlean_adam")


def _bits(x: float) -> int:
    return U64.unpack(F64.pack(x))[0]


def _tags(schema) -> list[int]:
    return [0 if (r := schema.representative(i)) is None else r + 1 for i in range(len(schema))]


def write_torchlean_adam(path: PathLike, target, state: OptState, *, rng_counter: Optional[int] = None) -> Path:
    """Write ``state`` (an Adam or AdamW history of ``target``) as ``TLADAMF``: version 4
    with ``rng_counter``, else 3 when the layout has aliases, else 2."""
    op = "write_torchlean_adam"
    params = params_of(op, target)
    if not isinstance(state, OptState) or not isinstance(state.hyper, (Adam, AdamW)):
        raise CheckpointError(f"{op}: expected an Adam or AdamW optimizer state, got {type(state).__name__}")
    schema = params.schema()
    problems = schema.problems()
    if problems:
        raise CheckpointError(f"{op}: malformed parameter schema: {problems[0]}")
    if len(state.slots) != len(params):
        raise CheckpointError(f"{op}: the state has {len(state.slots)} slots, the parameters {len(params)}")
    reps = [i for i in range(len(schema)) if schema.is_representative(i)]
    entries = []
    for i in reps:
        rec = state.slots[i]
        if not isinstance(rec, AdamState) or rec.step == 0:
            raise CheckpointError(f"{op}: no Adam or AdamW update has initialized optimizer state (slot {i})")
        n = params[i].storage.host.numel()
        # Intentional device-to-host reads: saving asks for the moments.
        m, v = (t.detach().to("cpu", torch.float32).contiguous().reshape(-1) for t in (rec.m, rec.v))
        if m.numel() != n or v.numel() != n:
            raise CheckpointError(f"{op}: slot {i}: moment sizes {m.numel()}/{v.numel()}, expected {n}")
        entries.append((i, rec.step, n, m.numpy().astype("<f4").tobytes(), v.numpy().astype("<f4").tobytes()))
    h = state.hyper
    version = 4 if rng_counter is not None else 3 if schema.has_aliases() else 2
    out = [MAGIC, _u64(version), _u64(1 if isinstance(h, AdamW) else 0)]
    out += [_u64(_bits(x)) for x in (h.beta1, h.beta2, h.eps, getattr(h, "weight_decay", 0.0))]
    if version == 4:
        out.append(_u64(rng_counter))
    out.append(_u64(len(schema)))
    for shape, flag in zip(schema.shapes, schema.requires_grad):
        out += [_u64(len(shape))] + [_u64(d) for d in shape]
        out += [_u64(int(torch.Size(shape).numel())), _u64(int(flag))]
    if version >= 3:
        out += [_u64(t) for t in _tags(schema)]
    out.append(_u64(len(entries)))
    for i, t, n, m, v in entries:
        out += [_u64(i), _u64(t), _u64(n), m, v]
    return atomic_write_bytes(path, b"".join(out), op)


def read_torchlean_adam(
    path: PathLike, target, optimizer: Optional[Optimizer] = None, *, with_counter: bool = True
) -> AdamFile:
    """Validate a ``TLADAMF`` file against ``target`` (and ``optimizer``, whose config
    must match bit for bit), then return the state; nothing of the caller's changes.

    ``with_counter``: the destination keeps an RNG counter (as TorchLean's trainer does):
    a file without one warns that stochastic training cannot resume exactly; without it,
    a file that has one is rejected.
    """
    params = params_of("read_torchlean_adam", target)
    op = f"read_torchlean_adam: {path}"
    r = ByteReader(read_regular(op, path), op)
    schema = params.schema()
    if r.take(len(MAGIC)) != MAGIC:
        raise CheckpointError(f"{op}: unsupported checkpoint family")
    version = r.u64()
    if version not in (2, 3, 4):
        raise CheckpointError(f"{op}: unsupported format version {version}; expected 2, 3 or 4")
    if version == 2 and schema.has_aliases():
        raise CheckpointError(f"{op}: version 2 cannot restore shared parameter histories")
    tag = r.u64()
    if tag not in (0, 1):
        raise CheckpointError(f"{op}: unknown optimizer kind tag {tag} (0 = Adam, 1 = AdamW)")
    beta1, beta2, eps, wd = (F64.unpack(U64.pack(r.u64()))[0] for _ in range(4))
    lr = optimizer.lr if optimizer is not None else 1e-3
    try:
        hyper = AdamW(lr, wd, beta1, beta2, eps) if tag == 1 else Adam(lr, beta1, beta2, eps)
    except ConfigError as e:
        raise CheckpointError(f"{op}: invalid optimizer config ({e})") from None
    if optimizer is not None and (
        type(optimizer.hyper) is not type(hyper)
        or [_bits(x) for x in hyper.without_lr()[1:] if isinstance(x, float)]
        != [_bits(x) for x in optimizer.hyper.without_lr()[1:] if isinstance(x, float)]
        or optimizer.hyper.numerics != "fast"
    ):
        raise CheckpointError(
            f"{op}: checkpoint belongs to a different optimizer configuration: file has "
            f"{hyper.describe()}, destination uses {optimizer.hyper.describe()}"
        )
    counter = r.u64() if version == 4 else None
    count = r.u64()
    if count != len(schema):
        raise CheckpointError(f"{op}: parameter count: file has {count}, destination has {len(schema)}")
    for i, (shape, flag) in enumerate(zip(schema.shapes, schema.requires_grad)):
        rank = r.u64()
        dims = tuple(r.u64() for _ in range(rank))
        numel, got_flag = r.u64(), r.u64()
        if got_flag not in (0, 1):
            raise CheckpointError(f"{op}: slot {i}: invalid `requiresGrad` flag {got_flag}")
        if dims != shape or numel != int(torch.Size(shape).numel()) or bool(got_flag) != flag:
            raise CheckpointError(
                f"{op}: slot {i}: schema mismatch: file has shape {dims} ({numel} values, "
                f"trainable={bool(got_flag)}), destination has {shape} (trainable={flag})"
            )
    if version >= 3:
        for i, want in enumerate(_tags(schema)):
            if r.u64() != want:
                raise CheckpointError(f"{op}: storage alias mismatch for parameter {i}")
    n_entries = r.u64()
    reps = [i for i in range(len(schema)) if schema.is_representative(i)]
    if n_entries != len(reps):
        raise CheckpointError(f"{op}: {n_entries} state entries, the destination has {len(reps)} histories")
    moments: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}
    for _ in range(n_entries):
        i, t, n = r.u64(), r.u64(), r.u64()
        if i in moments:
            raise CheckpointError(f"{op}: duplicate state entry for parameter {i}")
        if i >= len(schema) or not schema.is_representative(i):
            raise CheckpointError(f"{op}: parameter {i} does not own optimizer state")
        if t == 0:
            raise CheckpointError(f"{op}: parameter {i}: step count 0 (no update initialized it)")
        if n != int(torch.Size(schema.shapes[i]).numel()):
            raise CheckpointError(f"{op}: parameter {i}: {n} moment values, expected {torch.Size(schema.shapes[i]).numel()}")
        m = torch.frombuffer(bytearray(r.take(4 * n)), dtype=torch.float32) if n else torch.zeros(0)
        v = torch.frombuffer(bytearray(r.take(4 * n)), dtype=torch.float32) if n else torch.zeros(0)
        moments[i] = (t, m, v)
    if r.trailing():
        raise CheckpointError(f"{op}: {r.trailing()} trailing bytes")
    if counter is not None and not with_counter:
        raise CheckpointError(f"{op}: the file has a random counter and the destination keeps none")
    if counter is None and with_counter:
        warnings.warn(LEGACY_WARNING, stacklevel=2)
    return AdamFile(Optimizer(hyper), _state(params, hyper, moments), version, counter)


def _powers(beta: float, t: int) -> float:
    power = 1.0
    for _ in range(t):  # repeated left multiplication from 1, as the update does
        power *= beta
    return power


def _state(params, hyper, moments: dict) -> OptState:
    native = params.has_mirrors() and Optimizer(hyper).native
    slots: list = [None] * len(params)
    for i, c in enumerate(params.canonical_slot_indices()):
        if c == i:
            t, m, v = moments[i]
            s = params[i].storage
            like = s.mirror if native else s.host
            shape = like.shape
            slots[i] = AdamState(  # the file's logical values in the parameter's kernel layout
                t, to_layout(m.reshape(shape).to(like.dtype), like), to_layout(v.reshape(shape).to(like.dtype), like),
                _powers(hyper.beta1, t), _powers(hyper.beta2, t),
            )
        elif c is not None and not native:
            slots[i] = slots[c]
    steps = max((t for t, _, _ in moments.values()), default=0)
    return OptState(hyper, hyper.lr, NATIVE if native else GENERIC, tuple(slots), steps)
