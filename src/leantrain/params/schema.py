"""The checkpoint parameter schema (spec §9.1): shapes, trainability, alias map."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

Shape = tuple[int, ...]


@dataclass(frozen=True)
class ParameterSchema:
    """Shapes and ``requires_grad`` per slot, plus the alias map when there are aliases.

    ``representatives`` is ``None`` for a layout without aliases (the plain layout),
    otherwise the canonical slot map (``None`` at frozen slots).
    """

    shapes: tuple[Shape, ...]
    requires_grad: tuple[bool, ...]
    representatives: Optional[tuple[Optional[int], ...]] = None

    @classmethod
    def of_params(cls, params) -> "ParameterSchema":
        shapes = tuple(tuple(s) for s in params.shapes)
        flags = tuple(params.requires_grad_array())
        reps = tuple(params.canonical_slot_indices())
        schema = cls(shapes, flags, reps)
        return schema if schema.has_aliases() else cls(shapes, flags, None)

    def __len__(self) -> int:
        return len(self.shapes)

    def representative(self, i: int) -> Optional[int]:
        """The slot owning slot ``i``'s optimizer history, or ``None`` (frozen / out of range)."""
        if self.representatives is None:
            return i if 0 <= i < len(self.requires_grad) and self.requires_grad[i] else None
        return self.representatives[i] if 0 <= i < len(self.representatives) else None

    def is_representative(self, i: int) -> bool:
        return self.representative(i) == i

    def optimizer_state_count(self) -> int:
        return sum(self.is_representative(i) for i in range(len(self.shapes)))

    def trainable_count(self) -> int:
        return sum(self.requires_grad)

    def has_aliases(self) -> bool:
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
        return not self.problems()
