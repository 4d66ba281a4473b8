"""Parameter storage: the host tensor, its optional device mirror, and who is current.

A ``Storage`` is the unit of identity for aliasing (spec §1): two slots alias
iff they hold the same ``Storage`` object. It owns

* ``host``: the host tensor (for a list built from a module, the module's own
  tensor, so host writes are visible to the module);
* ``mirror``: an optional tensor on a device (CUDA, or a separate CPU tensor in
  tests) that the native optimizer path and the runner's forward pass use;
* ``host_current``: ``False`` once the mirror was written and the host is stale.

Host writes copy into ``host`` in place (so every tensor that views it, such as
a module parameter, sees the write), drop the mirror and mark the host current.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import PackError, shape_str


def canonical_device(device) -> torch.device:
    """``torch.device`` with an explicit index for accelerators (``cuda`` -> ``cuda:0``),
    so device comparisons match the ``.device`` of tensors."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


class Storage:
    """One parameter's mutable cells: host tensor, device mirror, host-current flag."""

    __slots__ = ("host", "mirror", "host_current")

    def __init__(self, host: torch.Tensor) -> None:
        self.host: torch.Tensor = host
        self.mirror: Optional[torch.Tensor] = None
        self.host_current: bool = True

    @property
    def shape(self) -> tuple[int, ...]:
        """The host tensor's shape."""
        return tuple(self.host.shape)

    @property
    def dtype(self) -> torch.dtype:
        """The host tensor's dtype."""
        return self.host.dtype

    def write_host(self, value: torch.Tensor) -> None:
        """Host write: copy ``value`` into the host tensor, drop the mirror, host current. A
        host tensor whose memory a ``"parameters"`` run released (its storage resized to
        nothing) gets its memory back first: a write never lands outside its storage."""
        self.mirror = None  # not freed eagerly: a caller may still hold it
        h = self.host
        if h.numel():
            need = (h.storage_offset() + sum((n - 1) * s for n, s in zip(h.shape, h.stride())) + 1) * h.element_size()
            if h.untyped_storage().nbytes() < need:
                h.untyped_storage().resize_(need)
        with torch.no_grad():
            h.copy_(value)
        self.host_current = True

    def write_mirror(self, value: torch.Tensor, op: str = "Storage.write_mirror") -> None:
        """Device write: replace the mirror with ``value``; the host becomes stale."""
        if tuple(value.shape) != self.shape:
            raise PackError(
                f"{op}: mirror shape mismatch: expected {shape_str(self.shape)}, "
                f"got {shape_str(value.shape)}"
            )
        self.mirror = value
        self.host_current = False

    def sync_to_host(self) -> None:
        """Copy a newer mirror to the host; keep the mirror. No-op when current."""
        if self.host_current:
            return
        if self.mirror is not None:
            with torch.no_grad():
                # Intentional device-to-host sync: the caller asked for current host values.
                self.host.copy_(self.mirror)
        self.host_current = True

    def make_mirror(self, device: torch.device) -> torch.Tensor:
        """Give this storage a mirror on ``device`` (a fresh copy of the current value)."""
        if self.mirror is not None and self.mirror.device == device:
            return self.mirror
        self.sync_to_host()
        mirror = self.host.detach().to(device, copy=True)
        if isinstance(self.host, torch.nn.Parameter):
            mirror = torch.nn.Parameter(mirror, requires_grad=self.host.requires_grad)
        self.mirror = mirror
        self.host_current = True  # the mirror was just made from the host: both agree
        return mirror

    def newest(self) -> torch.Tensor:
        """The tensor holding the newest value: the mirror after a device write, else the host."""
        return self.host if self.host_current or self.mirror is None else self.mirror

    def working(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """The tensor computation should read: the mirror if any, else the host.

        With ``device`` given, a storage whose host lives elsewhere and has no mirror
        there gets one (a host-to-device upload, never a read back).
        """
        if self.mirror is not None and (device is None or self.mirror.device == device):
            return self.mirror
        if device is None or self.host.device == device:
            return self.host
        return self.make_mirror(device)

    def begin_host_update(self) -> torch.Tensor:
        """Prepare an in-place host update (generic optimizer path): sync, drop mirror."""
        self.sync_to_host()
        self.mirror = None
        self.host_current = True
        return self.host
