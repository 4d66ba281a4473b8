"""One view of a parameter storage (seed: Trainer Parameters, spec §1).

A ``Param`` is a ``Storage`` plus ``requires_grad`` and an optional name. Several
views may share one storage: a tied weight, or a frozen view of a trainable one.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import PackTypeError, shape_str
from .storage import Storage

Shape = tuple[int, ...]


class Param:
    """One view of a parameter storage.

    ``Param(value)`` allocates a fresh storage holding a copy of ``value``;
    ``p.view(...)`` returns another view of the *same* storage (a tied slot, or a
    frozen view of a trainable storage).
    """

    __slots__ = ("storage", "requires_grad", "name")

    def __init__(
        self, value: torch.Tensor, *, name: Optional[str] = None, requires_grad: bool = True
    ) -> None:
        if not isinstance(value, torch.Tensor):
            raise PackTypeError(f"Param: expected a torch.Tensor, got {type(value).__name__}")
        self.storage = Storage(value.detach().clone())
        self.requires_grad = bool(requires_grad)
        self.name = name

    @classmethod
    def of_storage(
        cls, storage: Storage, *, requires_grad: bool = True, name: Optional[str] = None
    ) -> "Param":
        """A view of an existing ``storage`` (two views of one storage are a tie)."""
        view = cls.__new__(cls)
        view.storage, view.requires_grad, view.name = storage, bool(requires_grad), name
        return view

    def view(self, *, requires_grad: Optional[bool] = None, name: Optional[str] = None) -> "Param":
        """Another view of this storage; unspecified fields are copied from this view."""
        return Param.of_storage(
            self.storage,
            requires_grad=self.requires_grad if requires_grad is None else requires_grad,
            name=self.name if name is None else name,
        )

    @property
    def shape(self) -> Shape:
        """The storage's shape (``()`` for a scalar)."""
        return self.storage.shape

    @property
    def dtype(self) -> torch.dtype:
        """The storage's dtype."""
        return self.storage.dtype

    def value(self) -> torch.Tensor:
        """A snapshot of the host value; never syncs, so it may be stale."""
        return self.storage.host.detach().clone()

    def __repr__(self) -> str:
        flag = "trainable" if self.requires_grad else "frozen"
        return f"Param({self.name or '?'}, shape={shape_str(self.shape)}, {flag})"
