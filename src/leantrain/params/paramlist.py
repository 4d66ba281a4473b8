"""Shape-indexed parameter lists (seed: Trainer Parameters, spec §1-§2).

A ``ParamList`` is an ordered list of ``Param`` views; the same storage may sit at
several slots (tied weights), trainable or frozen. Slot indices are never
compressed: every map, pack and schema has one entry per slot.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence, Union

import torch

from ..errors import AliasError, PackError, PackTypeError, shape_str, slot_label
from .dense import internal_overlap
from .module_slots import module_slots
from .param import Param
from .schema import ParameterSchema
from .storage import Storage, canonical_device

Shape = tuple[int, ...]
Device = Union[str, torch.device]


class ParamList:
    """An ordered, shape-indexed list of parameter views (parameters, then buffers).

    ``views``: the slots' ``Param`` objects in slot order (a tuple, fixed at creation:
    per-update code reads it without a call per slot)."""

    __slots__ = ("views", "__weakref__")

    def __init__(self, views: Sequence[Param]) -> None:
        for i, v in enumerate(views):
            if not isinstance(v, Param):
                raise PackTypeError(
                    f"ParamList: slot {i}: expected a Param, got {type(v).__name__}"
                )
        for i, v in enumerate(views):
            if v.requires_grad and internal_overlap(v.storage.host):
                # As torch.optim: an update cannot write a cell that two elements share.
                t = v.storage.host
                raise AliasError(
                    f"ParamList: {slot_label(i, v.name)}: a trainable tensor whose elements share memory "
                    f"(shape {shape_str(t.shape)}, stride {tuple(t.stride())}: expanded or self-overlapping) "
                    f"cannot be updated; give it its own memory (.clone()) or freeze it"
                )
        self.views: tuple[Param, ...] = tuple(views)

    # ----------------------------------------------------------------- building
    @classmethod
    def of_pack(cls, pack: Sequence[torch.Tensor]) -> "ParamList":
        """One fresh trainable storage per tensor; never aliases, even for equal tensors."""
        _check_tensors("ParamList.of_pack", pack)
        return cls([Param(t) for t in pack])

    @classmethod
    def of_pack_with_requires_grad(
        cls, pack: Sequence[torch.Tensor], flags: Sequence[bool]
    ) -> "ParamList":
        """Fresh storages with an explicit trainability mask (same length as the pack)."""
        op = "ParamList.of_pack_with_requires_grad"
        _check_tensors(op, pack)
        if len(flags) != len(pack):
            word = "shorter" if len(flags) < len(pack) else "longer"
            raise PackError(
                f"{op}: requires_grad mask is {word} than the pack: expected {len(pack)} "
                f"flags, got {len(flags)}"
            )
        for i, f in enumerate(flags):
            if not isinstance(f, bool):
                raise PackTypeError(f"{op}: flag {i}: expected a bool, got {type(f).__name__}")
        return cls([Param(t, requires_grad=f) for t, f in zip(pack, flags)])

    @classmethod
    def from_module(cls, module: torch.nn.Module) -> "ParamList":
        """Parameters (tied ones at every slot), then buffers as frozen slots.

        Tensors over the same memory with the same view are one storage; a partial
        overlap between slots is an ``AliasError`` naming both.
        """
        return cls(module_slots(module))

    # ---------------------------------------------------------------- sequence
    def __len__(self) -> int:
        return len(self.views)

    def __getitem__(self, index: int) -> Param:
        return self.views[index]

    def __iter__(self) -> Iterator[Param]:
        return iter(self.views)

    def __repr__(self) -> str:
        return f"ParamList({len(self)} slots)"

    @property
    def shapes(self) -> list[Shape]:
        """Each slot's shape, in slot order."""
        return [v.shape for v in self.views]

    @property
    def names(self) -> list[Optional[str]]:
        """Each slot's name (``None`` where it has none), in slot order."""
        return [v.name for v in self.views]

    @property
    def dtypes(self) -> list[torch.dtype]:
        """Each slot's dtype, in slot order."""
        return [v.dtype for v in self.views]

    def label(self, index: int) -> str:
        """How messages name slot ``index``: ``slot 3 ('decoder.weight')``."""
        return slot_label(index, self.views[index].name)

    # ------------------------------------------------------------------ seed 1
    def requires_grad_array(self) -> list[bool]:
        """The trainability mask in slot order."""
        return [v.requires_grad for v in self.views]

    def optimizer_storage(self) -> list[Optional[Storage]]:
        """The storage of each trainable slot, ``None`` at frozen slots. Reads no data."""
        return [v.storage if v.requires_grad else None for v in self.views]

    def canonical_slot_indices(self) -> list[Optional[int]]:
        """Map each trainable slot to the first trainable slot with the same storage.

        Frozen slots map to ``None`` and are invisible to the search, so a frozen
        first occurrence never becomes a representative: ``[frozen p, p, q, p]``
        gives ``[None, 1, 2, 1]``. Rebuilt on every call (one dict keyed by storage
        identity), so re-tying and un-tying are always honoured.
        """
        first: dict[int, int] = {}
        out: list[Optional[int]] = []
        for i, v in enumerate(self.views):
            if not v.requires_grad:
                out.append(None)
            else:
                out.append(first.setdefault(id(v.storage), i))
        return out

    def storages(self) -> list[Storage]:
        """Every distinct storage once, in order of first occurrence (frozen included)."""
        seen: dict[int, Storage] = {}
        for v in self.views:
            seen.setdefault(id(v.storage), v.storage)
        return list(seen.values())

    def values(self) -> list[torch.Tensor]:
        """Snapshots of the host values in slot order, with no sync (may be stale)."""
        return [v.storage.host.detach().clone() for v in self.views]

    def values_synced(self) -> list[torch.Tensor]:
        """Snapshots after copying every newer mirror to the host.

        Syncs the device when a mirror is newer than its host tensor (intended:
        the caller asked for current values).
        """
        for s in self.storages():
            s.sync_to_host()
        return self.values()

    def set_values(self, pack: Sequence[torch.Tensor]) -> None:
        """Host-write ``pack[i]`` into slot ``i`` for every slot, frozen slots included.

        The count and every shape and dtype are checked before the first write. With
        aliases the same storage is written several times; the last occurrence wins.
        """
        self.check_pack("ParamList.set_values", pack)
        for v, t in zip(self.views, pack):
            v.storage.write_host(t)

    # ----------------------------------------------------------------- devices
    def to_device(self, device: Device) -> "ParamList":
        """Give every storage a mirror on ``device`` (``"cpu"`` makes a separate CPU copy)."""
        dev = canonical_device(device)
        for s in self.storages():
            s.make_mirror(dev)
        return self

    def has_mirrors(self) -> bool:
        """True when every storage has a device mirror."""
        return bool(self.views) and all(s.mirror is not None for s in self.storages())

    # -------------------------------------------------------------- validation
    def check_pack(
        self, op: str, pack: Sequence[Optional[torch.Tensor]], allow_none_frozen: bool = False,
        gradients: bool = False,
    ) -> None:
        """Raise unless ``pack`` has one tensor per slot with the slot's shape and dtype.

        ``allow_none_frozen``: ``None`` at frozen slots; ``gradients``: a gradient pack,
        where ``None`` anywhere means "no gradient" and sparse COO tensors are allowed
        (the optimizer decides whether its rule takes them)."""
        if not isinstance(pack, (list, tuple)):
            raise PackTypeError(f"{op}: expected a list of tensors, got {type(pack).__name__}")
        if len(pack) != len(self.views):
            raise PackError(
                f"{op}: pack length mismatch: expected {len(self.views)} tensors "
                f"(one per slot), got {len(pack)}; pass the pack in slot order, see ParamList.shapes"
            )
        for i, (v, t) in enumerate(zip(self.views, pack)):
            if t is None and (gradients or (allow_none_frozen and not v.requires_grad)):
                continue
            check_slot_tensor(op, i, v.name, v.shape, v.dtype, t, sparse=gradients)

    def schema(self):
        """The checkpoint parameter schema of spec §9.1 for this list."""
        return ParameterSchema.of_params(self)


def check_slot_tensor(
    op: str, i: int, name: Optional[str], shape: Shape, dtype: torch.dtype, t: object, sparse: bool = False
) -> None:
    """Raise unless ``t`` is a dense tensor holding data, with ``shape`` and ``dtype``
    (``sparse``: a sparse COO tensor is accepted too)."""
    if (isinstance(t, torch.Tensor) and t.shape == shape and t.dtype == dtype and t.layout == torch.strided
            and not t.is_meta and not t.is_quantized):
        return  # the usual case, checked first: this runs per slot of every public update
    where = slot_label(i, name)
    ok_layout = (torch.strided, torch.sparse_coo) if sparse else (torch.strided,)
    if isinstance(t, torch.Tensor) and (t.is_meta or t.layout not in ok_layout or t.is_quantized):
        kind = "a meta tensor (no data)" if t.is_meta else f"a {t.layout} tensor" if t.layout != torch.strided \
            else "a quantized tensor"
        raise PackError(f"{op}: {where}: expected a dense tensor with data, got {kind}")
    if isinstance(t, torch.Tensor) and t.shape == shape and t.dtype == dtype:
        return
    if not isinstance(t, torch.Tensor):
        raise PackTypeError(f"{op}: {where}: expected a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise PackError(
            f"{op}: {where}: expected shape {shape_str(shape)}, got {shape_str(t.shape)}"
        )
    raise PackError(f"{op}: {where}: expected dtype {dtype}, got {t.dtype}")


def _check_tensors(op: str, pack: Sequence[object]) -> None:
    if not isinstance(pack, (list, tuple)):
        raise PackTypeError(f"{op}: expected a list of tensors, got {type(pack).__name__}")
    for i, t in enumerate(pack):
        if not isinstance(t, torch.Tensor):
            raise PackTypeError(f"{op}: slot {i}: expected a torch.Tensor, got {type(t).__name__}")


def params_of(op: str, target: object) -> ParamList:
    """The parameter list of ``target``: a ``ParamList``, or anything holding one as
    ``.params`` (a ``Runner``)."""
    if isinstance(target, ParamList):
        return target
    params = getattr(target, "params", None)
    if isinstance(params, ParamList):
        return params
    raise PackTypeError(f"{op}: expected a Runner or a ParamList, got {type(target).__name__}")
