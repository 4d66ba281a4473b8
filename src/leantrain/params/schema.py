"""The parameter schema (spec §9.1): shapes, trainability and the alias map, plus the
names, dtypes and storage indices leantrain's files record.

The one description of a slot layout that checkpoints, weights files and the
TorchLean formats write and check against: ``params.schema()`` describes a list,
``ParameterSchema.from_manifest`` reads a checkpoint's, ``differences`` names every
way two layouts disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

Shape = tuple[int, ...]


@dataclass(frozen=True)
class ParameterSchema:
    """Shapes and ``requires_grad`` per slot, plus the alias map when there are aliases.

    ``representatives`` is ``None`` for a layout without aliases (the plain layout),
    otherwise the canonical slot map (``None`` at frozen slots). ``names``, ``dtypes``
    (``"float32"``...) and ``storages`` (the storage index of each slot, in order of
    first occurrence) are set for a schema read from a parameter list or a file.
    """

    shapes: tuple[Shape, ...]
    requires_grad: tuple[bool, ...]
    representatives: Optional[tuple[Optional[int], ...]] = None
    names: Optional[tuple[Optional[str], ...]] = None
    dtypes: Optional[tuple[str, ...]] = None
    storages: Optional[tuple[int, ...]] = None

    @classmethod
    def of_params(cls, params) -> "ParameterSchema":
        """The schema of a parameter list: shapes, dtypes, names, frozen flags and ties."""
        shapes = tuple(tuple(s) for s in params.shapes)
        flags = tuple(params.requires_grad_array())
        reps = tuple(params.canonical_slot_indices())
        index = {id(s): k for k, s in enumerate(params.storages())}
        extra = dict(
            names=tuple(params.names),
            dtypes=tuple(str(d).removeprefix("torch.") for d in params.dtypes),
            storages=tuple(index[id(v.storage)] for v in params),
        )
        schema = cls(shapes, flags, reps, **extra)
        return schema if schema.has_aliases() else cls(shapes, flags, None, **extra)

    # ----------------------------------------------------------- files
    def slots_manifest(self) -> list[dict]:
        """One entry per slot, as a checkpoint manifest stores it."""
        return [
            {"name": self.names[i] if self.names else None, "shape": list(self.shapes[i]),
             "dtype": self.dtypes[i] if self.dtypes else None,
             "requires_grad": self.requires_grad[i],
             "storage": self.storages[i] if self.storages else None}
            for i in range(len(self))
        ]

    def representatives_list(self) -> list[Optional[int]]:
        """The canonical slot map, one entry per slot (written even without aliases)."""
        return [self.representative(i) for i in range(len(self))]

    @classmethod
    def from_manifest(cls, slots: object, representatives: object) -> "ParameterSchema":
        """The schema a checkpoint manifest describes; ``ValueError`` when it is malformed."""
        if not isinstance(slots, list) or not all(isinstance(e, dict) for e in slots):
            raise ValueError("the slot schema must be a list of slot entries")
        if not isinstance(representatives, list) or len(representatives) != len(slots):
            raise ValueError("the alias map must be a list with one entry per slot")
        try:
            return cls(
                tuple(tuple(int(d) for d in e["shape"]) for e in slots),
                tuple(bool(e["requires_grad"]) for e in slots),
                tuple(representatives),
                names=tuple(e.get("name") for e in slots),
                dtypes=tuple(e.get("dtype") for e in slots),
                storages=tuple(e.get("storage") for e in slots),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed slot entry ({type(e).__name__}: {e})") from None

    def with_requires_grad(self, mask) -> "ParameterSchema":
        """This layout with another trainable set (its alias map recomputed as
        ``canonical_slot_indices`` would: the first trainable slot of each storage)."""
        first: dict = {}
        reps = tuple(first.setdefault(k, i) if flag else None for i, (flag, k) in enumerate(zip(mask, self.storages)))
        schema = replace(self, requires_grad=tuple(bool(f) for f in mask), representatives=reps)
        return schema if schema.has_aliases() else replace(schema, representatives=None)

    def differences(self, here: "ParameterSchema") -> list[str]:
        """Every way ``here`` (the destination) differs from this (saved) layout, each
        cause once: a shape or dtype that differs at a storage is reported at its first
        slot, naming the slots that share it."""
        if len(self) != len(here):
            return [f"slot count: checkpoint has {len(self)} slots, destination has {len(here)}"]
        out: list[str] = []
        shared: dict[tuple, tuple[int, list[int]]] = {}  # (storage, field, values) -> (message, slots)
        fields = (("name", "names"), ("shape", "shapes"), ("dtype", "dtypes"),
                  ("frozen mask", "requires_grad"))
        for i in range(len(self)):
            where = f"slot {i} ({here.names[i]!r})" if here.names and here.names[i] else f"slot {i}"
            for what, attr in fields:
                a, b = getattr(self, attr), getattr(here, attr)
                a_i = a[i] if a is not None else None
                b_i = b[i] if b is not None else None
                if a_i != b_i:
                    a_i, b_i = (list(a_i), list(b_i)) if attr == "shapes" else (a_i, b_i)
                    key = (here.storages[i] if here.storages else None, what, repr(a_i), repr(b_i))
                    if attr in ("shapes", "dtypes") and key[0] is not None and key in shared:
                        shared[key][1].append(i)  # the same storage's difference, seen at its first slot
                        continue
                    shared[key] = (len(out), [])
                    out.append(f"{where}: {what}: checkpoint has {a_i!r}, destination has {b_i!r}")
        for at, also in shared.values():
            if also:
                head, _, rest = out[at].partition(": ")
                out[at] = f"{head} (and slot{'s' if len(also) > 1 else ''} {', '.join(map(str, also))}, " \
                          f"sharing its storage): {rest}"
        if self.representatives_list() != here.representatives_list() or self.storages != here.storages:
            out.append(
                f"storage alias map: checkpoint has {self.representatives_list()} (storages "
                f"{list(self.storages or ())}), destination has {here.representatives_list()} "
                f"(storages {list(here.storages or ())})"
            )
        return out

    def __len__(self) -> int:
        return len(self.shapes)

    def representative(self, i: int) -> Optional[int]:
        """The slot owning slot ``i``'s optimizer history, or ``None`` (frozen / out of range)."""
        if self.representatives is None:
            return i if 0 <= i < len(self.requires_grad) and self.requires_grad[i] else None
        return self.representatives[i] if 0 <= i < len(self.representatives) else None

    def is_representative(self, i: int) -> bool:
        """Whether slot ``i`` is trainable and the first slot of its storage (it owns the optimizer state)."""
        return self.representative(i) == i

    def optimizer_state_count(self) -> int:
        """How many slots own optimizer state (one per trainable storage)."""
        return sum(self.is_representative(i) for i in range(len(self.shapes)))

    def trainable_count(self) -> int:
        """How many slots are trainable (a tie counts once per slot)."""
        return sum(self.requires_grad)

    def has_aliases(self) -> bool:
        """Whether any trainable slot shares its storage with an earlier one (a tie)."""
        return any(
            (r := self.representative(i)) is not None and r != i for i in range(len(self.shapes))
        )

    def problems(self) -> list[str]:
        """Every way this schema is malformed (empty when well formed)."""
        n = len(self.shapes)
        out = []
        if len(self.requires_grad) != n:
            out.append(f"requires_grad has {len(self.requires_grad)} entries for {n} shapes")
            return out
        if self.representatives is not None and len(self.representatives) != n:
            out.append(f"representatives has {len(self.representatives)} entries for {n} shapes")
            return out
        for i in range(n):
            r = self.representative(i)
            if r is None:
                if self.requires_grad[i]:
                    out.append(f"slot {i} is trainable but has no representative")
                continue
            if not (isinstance(r, int) and 0 <= r <= i):
                out.append(f"slot {i}: representative {r!r} is not an earlier slot")
            elif not (self.requires_grad[i] and self.requires_grad[r]):
                out.append(f"slot {i}: representative {r} links a frozen slot")
            elif self.shapes[r] != self.shapes[i]:
                out.append(f"slot {i}: shape {self.shapes[i]} differs from representative {r}")
            elif self.representative(r) != r:
                out.append(f"slot {i}: representative {r} does not map to itself")
        return out

    def is_well_formed(self) -> bool:
        """Whether ``problems()`` finds nothing."""
        return not self.problems()
