"""The runner: a model, a loss and the parameter list it trains (spec §6).

The module is evaluated at the pack's current values: every module location of a
slot is bound to the storage's working tensor (its device mirror if it has one,
else the host tensor). Gradients are per slot: when the layout has no aliases the
working tensors themselves are differentiated (a storage used at one slot *is* its
leaf); when it has aliases each occurrence gets its own leaf, so an alias receives
its own occurrence gradient and ``canonical_gradients`` sums them in slot order.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from .errors import ConfigError, DataError
from .module_slots import bind, module_entries
from .params import ParamList
from .storage import canonical_device

Sample = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

LOSSES: dict[str, LossFn] = {"mse": F.mse_loss, "cross_entropy": F.cross_entropy}


def check_sample(op: str, sample: object, index: int = 0) -> Sample:
    """A sample is an ``(x, y)`` pair of tensors (either may hold a minibatch)."""
    if (
        not isinstance(sample, (tuple, list))
        or len(sample) != 2
        or not all(isinstance(t, torch.Tensor) for t in sample)
    ):
        got = type(sample).__name__
        if isinstance(sample, (tuple, list)):
            got += f" of {len(sample)}: " + ", ".join(type(t).__name__ for t in sample)
        raise ConfigError(f"{op}: item {index}: expected an (x, y) pair of tensors, got {got}")
    return sample[0], sample[1]


class Runner:
    """Wraps ``module`` and ``loss``; owns ``params`` (parameters, then buffers, frozen)."""

    def __init__(self, module: torch.nn.Module, loss: Union[str, LossFn] = "mse") -> None:
        if isinstance(loss, str):
            if loss not in LOSSES:
                raise ConfigError(
                    f"Runner: unknown loss {loss!r}; expected one of {sorted(LOSSES)} or a callable"
                )
            loss_fn = LOSSES[loss]
        elif callable(loss):
            loss_fn = loss
        else:
            raise ConfigError(f"Runner: loss must be a name or a callable, got {type(loss).__name__}")
        self.module = module
        self.loss_name = loss if isinstance(loss, str) else getattr(loss, "__name__", "custom")
        self.loss_fn: LossFn = loss_fn
        self.params = ParamList.from_module(module)
        self._locations = [loc for _, _, loc in module_entries(module)]
        self._bound: list = [None] * len(self.params)
        self._buffer_slots = [i for i, loc in enumerate(self._locations) if not loc.is_parameter]
        hosts = [v.storage.host.device for v in self.params]
        self.device: torch.device = hosts[0] if hosts else torch.device("cpu")
        self.mode = "train"
        module.train()

    @classmethod
    def from_module(cls, module: torch.nn.Module, loss: Union[str, LossFn] = "mse") -> "Runner":
        return cls(module, loss)

    # ------------------------------------------------------------------ modes
    def train(self) -> "Runner":
        self.mode = "train"
        self.module.train()
        return self

    def eval(self) -> "Runner":
        self.mode = "eval"
        self.module.eval()
        return self

    def to(self, device: Union[str, torch.device]) -> "Runner":
        """Compute on ``device``: every storage gets a mirror there (host stays the owner)."""
        self.device = canonical_device(device)
        self.params.to_device(self.device)
        return self

    @property
    def has_buffer_updates(self) -> bool:
        return self.mode == "train" and bool(self._buffer_slots)

    # --------------------------------------------------------------- binding
    def _bind_working(self) -> list[Optional[torch.Tensor]]:
        """Bind the module to the current values; return one gradient leaf per trainable slot.

        Without aliases the leaves are the working tensors and the binding is stable,
        so this is a cheap identity check per slot on every step.
        """
        views = self.params
        slots_map = views.canonical_slot_indices()
        owners = {id(v.storage) for v, c in zip(views, slots_map) if c is not None}
        leaves: list[Optional[torch.Tensor]] = [None] * len(views)
        for i, (v, c) in enumerate(zip(views, slots_map)):
            w = v.storage.working(self.device)
            if c is None:
                if id(v.storage) in owners:
                    w = w.detach()  # a frozen view of a trainable storage passes no gradient
            elif c != i or not w.requires_grad:
                # An alias occurrence gets its own leaf over the same memory, so its
                # gradient is its own occurrence's (summed later in slot order).
                w = w.detach().requires_grad_(True)
            if c is not None:
                leaves[i] = w
            if self._bound[i] is not w:
                bind(self._locations[i], w)
                self._bound[i] = w
        return leaves

    def _mark_buffers_stale(self) -> None:
        for i in self._buffer_slots:
            s = self.params[i].storage
            if s.mirror is not None:
                s.host_current = False  # the forward pass advanced the mirror in place

    def _inputs(self, sample: Sample) -> Sample:
        x, y = sample
        if x.device != self.device:
            x = x.to(self.device)
        if y.device != self.device:
            y = y.to(self.device)
        return x, y

    # ------------------------------------------------------------ evaluation
    def loss(self, sample: Sample) -> torch.Tensor:
        """The scalar loss of one item at the current parameters (buffers may advance)."""
        x, y = self._inputs(sample)
        try:
            loss = self.loss_fn(self.module(x), y)
        except (RuntimeError, ValueError, TypeError, IndexError) as e:
            raise DataError(
                f"Runner.loss: the model or loss rejected the sample (x {tuple(x.shape)} {x.dtype}, "
                f"y {tuple(y.shape)} {y.dtype}): {str(e).splitlines()[0]}"
            ) from e
        if loss.dim() != 0:
            raise ConfigError(
                f"Runner.loss: the loss must be a scalar, got shape {tuple(loss.shape)}"
            )
        return loss

    def update_buffers(self, sample: Sample) -> None:
        """Advance buffers (e.g. BatchNorm statistics) on ``sample``; train mode only."""
        if not self.has_buffer_updates:
            return
        self._bind_working()
        with torch.no_grad():
            x, _ = self._inputs(check_sample("Runner.update_buffers", sample))
            try:
                self.module(x)
            except (RuntimeError, ValueError, TypeError, IndexError) as e:
                raise DataError(
                    f"Runner.update_buffers: the model rejected the sample (x {tuple(x.shape)} "
                    f"{x.dtype}): {str(e).splitlines()[0]}"
                ) from e
        self._mark_buffers_stale()

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output at the current parameters (no gradients, buffers unchanged)."""
        self._bind_working()
        with self.frozen_buffers():
            return self.module(x.to(self.device))

    def mean_loss(self, samples: Sequence[Sample]) -> float:
        """``(l1 + ... + ln) / n`` under the current parameters and mode; buffers unchanged.

        Reads one scalar back to the host (a device sync on CUDA), as asked.
        """
        if len(samples) == 0:
            raise DataError("Runner.mean_loss: empty sample list")
        samples = [check_sample("Runner.mean_loss", s, i) for i, s in enumerate(samples)]
        self._bind_working()
        with torch.no_grad(), self.frozen_buffers():
            total = self.loss(samples[0])
            for s in samples[1:]:
                total = total + self.loss(s)
        return float((total / len(samples)).item())  # intentional sync: the caller asked

    def loss_and_gradients(
        self, sample: Sample, leaves: Sequence[Optional[torch.Tensor]]
    ) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
        """Loss and per-slot gradients of one item (``None`` at frozen slots)."""
        return self._grads(self.loss(sample), leaves)

    def _grads(self, loss: torch.Tensor, leaves):
        wrt = [t for t in leaves if t is not None]
        grads = torch.autograd.grad(loss, wrt, allow_unused=True)
        it = iter(grads)
        out = []
        for t in leaves:
            if t is None:
                out.append(None)
            else:
                g = next(it)
                out.append(torch.zeros_like(t) if g is None else g)  # unused by the forward: zero
        return loss.detach(), out

    def frozen_buffers(self, on_error_only: bool = False):
        """A context that restores every buffer on exit (forward passes leave them as found);
        with ``on_error_only``, only when the block raises. Free without buffer updates."""
        if not self.has_buffer_updates:
            return _NO_GUARD
        return _BufferGuard(self, on_error_only)

    # ----------------------------------------------------------- vectorised
    def check_stackable(self, batch: Sequence[Sample]) -> None:
        """Raise unless the items stack and no layer couples them (checked before any change)."""
        op = "vectorized accumulation"
        if self.mode == "train":
            for name, m in self.module.named_modules():
                if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                    raise ConfigError(
                        f"{op}: module {name!r} ({type(m).__name__}) couples the items of a "
                        f"stacked batch in train mode; use accumulation='exact' or runner.eval()"
                    )
        x0, y0 = batch[0]
        for i, (x, y) in enumerate(batch):
            if x.shape != x0.shape or y.shape != y0.shape:
                raise ConfigError(
                    f"{op}: item {i} does not stack with item 0: x {tuple(x.shape)} vs "
                    f"{tuple(x0.shape)}, y {tuple(y.shape)} vs {tuple(y0.shape)}"
                )

    def stacked_loss_and_gradients(
        self, batch: Sequence[Sample], leaves: Sequence[Optional[torch.Tensor]], scale: Optional[float] = None
    ) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
        """Mean loss over a stacked batch and its gradient: one forward, one backward.

        Items are stacked along a new leading dimension and the model sees them as one
        batch; the per-item losses (the loss function mapped over the items) are summed
        and multiplied by ``scale`` (default ``1/n``). Refused when a layer couples the items.
        """
        self.check_stackable(batch)
        xs, ys = self._inputs((torch.stack([x for x, _ in batch]), torch.stack([y for _, y in batch])))
        per_item = torch.vmap(self.loss_fn)(self.module(xs), ys)
        total = per_item.sum()
        return self._grads(total * (1.0 / len(batch) if scale is None else scale), leaves)


_NO_GUARD = contextlib.nullcontext()


class _BufferGuard:
    def __init__(self, runner: Runner, on_error_only: bool = False) -> None:
        self.runner, self.on_error_only = runner, on_error_only
        self.saved: list = []

    def __enter__(self) -> None:
        runner = self.runner
        runner._bind_working()
        self.saved = [(t, t.clone()) for i in runner._buffer_slots if (t := runner._bound[i]) is not None]

    def __exit__(self, kind, *exc) -> None:
        if self.on_error_only and kind is None:
            return
        with torch.no_grad():
            for t, old in self.saved:
                t.copy_(old)
