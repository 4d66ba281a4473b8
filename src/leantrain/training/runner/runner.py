"""The runner: a model, a loss and the parameter list it trains (spec §6).

The module stays the user's: its Parameter objects, ties, buffers and ``state_dict()``
keys are the same after every call; only the trained values, the buffers the contract
advances and (gradual unfreezing) the trainable set the user changes move. Each call
binds the module for its own length (``binding.py``): a tied Parameter's later
occurrences get their own leaves over the same memory, summed in slot order. A
parameter or buffer replaced on the module is refused at the next call (``ConfigError``
naming the slot); a ``requires_grad`` turned on or off there is followed.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Optional, Sequence, Union

import torch

from .ema import EMA
from .backward import differentiate, reentrant_checkpoint
from .compiled import compiler_error, is_compiler_error, make_compiled
from .binding import MODEL_ERRORS, Binding, same_rng
from .loop_state import LoopState, RunnerStats, Steady
from .measure import mean_loss
from .module_view import ModuleView
from .wrapped import refuse_wrapped
from ...samples import (  # noqa: F401  (re-exported: LOSSES, LossFn)
    LOSSES, LossFn, LossSum, model_loss_of, Sample, call_model, check_sample, checked_loss, describe, loss_target, to_device,
)
from ...errors import ConfigError, DataError, LeantrainError
from ...params.meta import give_memory, refuse_unfilled
from ...params.paramlist import ParamList
from ...params.storage import canonical_device


class Runner:
    """Wraps ``module`` and ``loss``; owns ``params`` (parameters, then persistent
    buffers as frozen slots: the entries of ``module.state_dict()``)."""

    def __init__(self, module: torch.nn.Module, loss: Union[str, LossFn] = "mse") -> None:
        refuse_wrapped("Runner", module)  # DDP, fully_shard, DeepSpeed: the plain module and engine= instead
        if isinstance(loss, str):
            if loss not in LOSSES:
                raise ConfigError(f"Runner: unknown loss {loss!r}; expected one of {sorted(LOSSES)} or a callable")
            loss_fn = model_loss_of(module) if loss == "model" else LOSSES[loss]
        elif callable(loss):
            loss_fn = loss
        else:
            raise ConfigError(f"Runner: loss must be a name or a callable, got {type(loss).__name__}")
        # a module built on torch's meta device: memory of its own, unfilled until a run fills it (params/meta.py)
        self.unfilled: dict[int, str] = give_memory("Runner", module)
        self.built_on_meta = bool(self.unfilled)  # its "parameters" runs end released by default (gather_at_end)
        self.params = ParamList.from_module(module)  # validates the module first
        self.module = module
        self.loss_name = loss if isinstance(loss, str) else getattr(loss, "__name__", "custom")
        self.loss_fn: LossFn = loss_fn
        # Where each slot lives in the module, which are buffers: what a Binding rebinds (module_view.py).
        self.view = ModuleView(module)
        self.locations = self.view.locations
        self.buffer_slots = self.view.buffer_slots
        self.bound: Optional[Binding] = None  # the Binding in force during a call
        # whether the model's graph holds a reentrant activation checkpoint (learned at the first
        # gradient: None until then), so its gradients come from loss.backward()
        self.reentrant: Optional[bool] = None
        self.ema: Optional[EMA] = None  # the weights' moving average the newest loop with ema_decay kept
        self.loop = LoopState()  # what the running loop installed (``looping``); outside loops, nothing
        self.stats = RunnerStats()
        self._compiled_loss: Optional[Callable] = None  # made by the first compile=True loop, then kept
        # Facts learned about the model (reported by bindings): whether a train-mode forward writes
        # any buffer (by the tensors' version counters), whether it draws random numbers. None until seen.
        self.buffer_writes: Optional[bool] = None
        self.draws: Optional[bool] = None
        # each item shape's draws (None: not countable), whether the replay was said (draw_shift.py)
        self.draw_shifts: dict = {}
        self.replay_said = False
        self.one_leaf_per_tensor = False  # engine="ddp": a tie is one leaf (DDP reduces the module's own)
        self.sums_losses: Optional[bool] = None  # whether the loss is a LossSum (data parallel agrees on it once)
        hosts = [v.storage.host.device for v in self.params]
        self.device: torch.device = hosts[0] if hosts else torch.device("cpu")
        self.view.index(self.device)
        self.mode = "train"
        module.train()

    @classmethod
    def from_module(cls, module: torch.nn.Module, loss: Union[str, LossFn] = "mse") -> "Runner":
        """A runner over ``module``'s parameters and persistent buffers. ``loss``: ``"mse"``,
        ``"cross_entropy"``, ``"model"`` (the output's own loss) or ``loss(output, target)``
        returning a scalar tensor or a ``LossSum``. Raises ``ConfigError`` (an unknown loss, a lazy
        module, one wrapped by DDP/FSDP/DeepSpeed) or ``AliasError`` (parameters partly sharing memory)."""
        return cls(module, loss)

    # ------------------------------------------------------------------ modes
    def train(self) -> "Runner":
        """Train mode (the module's too): buffers advance and dropout draws. Returns the runner."""
        self.mode = "train"
        self.recheck()
        self.module.train()
        return self

    def eval(self) -> "Runner":
        """Eval mode (the module's too): no buffer pass, no dropout. Returns the runner."""
        self.mode = "eval"
        self.recheck()
        self.module.eval()
        return self

    @contextlib.contextmanager
    def in_mode(self, mode: str):
        """The block in ``mode`` (``"train"``/``"eval"``), then the mode put back; unlike
        ``train()``/``eval()`` it keeps what a loop checked (a mode changes no slot,
        binding or layout). For a loop's own evaluations."""
        saved = self.mode
        self.mode = mode
        self.module.train(mode == "train")
        try:
            yield self
        finally:
            self.mode = saved
            self.module.train(saved == "train")

    def to(self, device: Union[str, torch.device]) -> "Runner":
        """Compute on ``device``: every storage gets a mirror there (host stays the owner).
        A model built on meta and not yet filled is refused (its fill runs on the host)."""
        if self.unfilled and canonical_device(device).type != "cpu":
            name = next(iter(self.unfilled.values()))
            raise ConfigError(f"Runner.to: {name!r} was built on torch's meta device and has no values yet; a "
                              f"'parameters' run fills it in host memory, and device mirrors of a model built on "
                              f"meta are not supported yet: train it on the CPU device, or build it whole")
        self.device = canonical_device(device)
        self.recheck()
        self.params.to_device(self.device)
        self.view.index(self.device)
        return self

    def sync(self) -> None:
        """Copy newer device values back into the module's own tensors (a device sync
        when a mirror is newer; the loops call it once, when they return)."""
        for s in self.params.storages():
            s.sync_to_host()

    def autocast(self):
        """``torch.autocast`` on the runner's device when a loop asked for it, else nothing."""
        amp = self.loop.amp
        return contextlib.nullcontext() if amp is None else torch.autocast(self.device.type, dtype=amp)

    def keep_ema(self, ema: Optional[EMA]) -> None:
        """The moving average a loop with ``ema_decay`` keeps (it outlives the loop)."""
        self.ema = ema

    def compiled_loss(self) -> Callable:
        """The compiled loss of a sample (``compiled.py``), made on first use and kept."""
        if self._compiled_loss is None:
            self._compiled_loss = make_compiled(self.module, self.loss_fn)
        return self._compiled_loss

    # --------------------------------------------------- facts about the model
    def learned_buffer_writes(self, wrote: bool) -> None:
        """A binding saw a forward write a buffer (``True``), or write none (``False``,
        kept only until a write is seen)."""
        if wrote:
            self.buffer_writes = True
        elif self.buffer_writes is None:
            self.buffer_writes = False

    def learned_draws(self, states: list) -> bool:
        """Generator states around one forward per item: the model draws random numbers
        if the first and last differ (returned)."""
        self.draws = not same_rng(states[0], states[-1])
        return self.draws

    def learned_loss_kind(self, sums: bool) -> None:
        """The ranks agreed whether the loss is a ``LossSum`` (data parallel asks once)."""
        self.sums_losses = sums

    def counted_layout(self) -> None:
        """A step built an optimizer update layout (``stats.layouts``)."""
        self.stats.layouts += 1

    def counted_buffer_pass(self, ran: bool) -> None:
        """A step ran the buffer pass, or not (``stats.buffer_passes``)."""
        self.stats.buffer_passes += ran

    def counted_draw_forward(self) -> None:
        """A forward counted an item shape's random draws (``stats.draw_counts``)."""
        self.stats.draw_counts += 1

    def counted_redo(self) -> None:
        """A step was redone with the buffer pass (``stats.redone_steps``)."""
        self.stats.redone_steps += 1

    def entered(self, binding: Optional[Binding]) -> None:
        """A binding took effect (``None``: it ended)."""
        self.bound = binding

    def ema_values(self) -> list[torch.Tensor]:
        """Per slot, the moving average of the trained weights a loop with ``ema_decay``
        keeps (frozen slots and buffers: their current value); copies, on the storages'
        devices."""
        if self.ema is None:
            raise ConfigError("Runner.ema_values: no moving average: train with ema_decay=... first")
        return self.ema.slot_values(self.params)

    @property
    def has_buffer_updates(self) -> bool:
        """Whether a step may advance buffers: train mode and at least one buffer slot."""
        return self.mode == "train" and bool(self.buffer_slots)

    # ------------------------------------------------------------------ loops
    @contextlib.contextmanager
    def looping(self, state: LoopState):
        """Install ``state`` for the enclosed loop; what was there comes back afterwards,
        even when the loop raised."""
        outer, self.loop = self.loop, state
        try:
            yield state
        finally:
            self.loop = outer

    @contextlib.contextmanager
    def steady(self):
        """For the length of a training loop: what a step checks about the module, the
        slots and the optimizer state is checked at the first step and reused by the
        next ones, until ``recheck()``. The loops call ``user_code_ran()`` after any code
        of the user's runs between steps (a callback, a log line, an evaluation): the
        next step compares the module and slots with what they were when checked
        (``confirm_steady``) and checks everything again if anything differs, so a
        parameter replaced, frozen, re-tied or given other memory there is seen at the
        next step, as outside a loop, while a callback that changes nothing costs one
        comparison per slot instead of the checks."""
        loop = self.loop
        outer, loop.steady = loop.steady, Steady()
        try:
            yield self
        finally:
            loop.steady = outer

    def recheck(self) -> None:
        """Forget what the current loop checked: the next step checks everything again."""
        if self.loop.steady is not None:
            self.loop.steady.clear()

    def user_code_ran(self) -> None:
        """The user's code ran inside a loop: the next step confirms what was checked."""
        if self.loop.steady is not None:
            self.loop.steady.suspect = True

    def confirm_steady(self) -> None:
        """At the start of a loop's step: after the user's code ran, keep what was checked
        only if the module and slots look as they did then (``ModuleView.fingerprint``),
        else check everything again; a fresh stretch records what its checks see."""
        steady = self.loop.steady
        if steady is None:
            return
        if steady.suspect:
            steady.suspect = False
            if steady.fingerprint is None or steady.fingerprint != self.view.fingerprint(self.params):
                steady.clear()
        if steady.fingerprint is None:
            steady.fingerprint = self.view.fingerprint(self.params)

    def slot_map(self) -> list[Optional[int]]:
        """``params.canonical_slot_indices()``; computed once per steady stretch of a loop
        (read only: callers must not modify it)."""
        steady = self.loop.steady
        if steady is None:
            return self.params.canonical_slot_indices()
        if steady.slot_map is None:
            steady.slot_map = self.params.canonical_slot_indices()
        return steady.slot_map

    def slots_plain(self) -> bool:
        """Whether every slot is its own representative (no tie, nothing frozen): the
        canonical gradients are the gradients. Once per steady stretch of a loop."""
        steady = self.loop.steady
        if steady is not None and steady.plain is not None:
            return steady.plain
        smap = self.slot_map()
        plain = all(c == i for i, c in enumerate(smap))
        if steady is not None:
            steady.plain = plain
        return plain

    # --------------------------------------------------------------- binding
    def binding(self, op: str = "Runner") -> Binding:
        """The module bound at the current values for one call (use as a context).

        Checks first that the module still holds the objects the slots were read from
        (in a loop: at its first step and after each ``recheck()``; a binding that swaps
        nothing in, the usual case, is then reused as it is).
        """
        if self.bound is not None:
            return self.bound
        steady = self.loop.steady
        if steady is not None:
            b = steady.binding
            if b is None:
                b = self._bind(op)
                if not b.swaps:
                    steady.binding = b
            return b
        return self._bind(op)

    def _bind(self, op: str) -> Binding:
        refuse_unfilled(op, self.unfilled)
        binding = self.view.bind(self, op)
        self.stats.bindings += 1
        return binding

    def follow_changed_requires_grad(self) -> None:
        """Slots follow a ``requires_grad`` changed on the module: one turned on trains with
        a fresh optimizer history (as torch.optim); one turned off gets no update."""
        for i in self.view.changed_requires_grad():
            self.params[i].requires_grad = bool(self.view.originals[i].requires_grad)
        self.view.index(self.device)
        if self.loop.steady is not None:
            self.loop.steady.clear()  # the trainable set changed: its map and layout too

    def follow_requires_grad(self, mask) -> None:
        """Each slot's flag from ``mask``, each module Parameter's ``requires_grad`` to
        whether any of its slots trains (``load_checkpoint(follow_trainable=True)``)."""
        for i, flag in enumerate(mask):
            self.params[i].requires_grad = bool(flag)
        wants = self.view.trainable_wanted(mask)
        for i, orig in enumerate(self.view.originals):
            if self.view.locations[i].is_parameter and orig.requires_grad != wants[id(orig)]:
                orig.requires_grad_(wants[id(orig)])
        self.view.index(self.device)
        self.recheck()

    def mark_buffers_stale(self) -> None:
        """Mark the buffers' host copies stale after a forward advanced their device mirrors."""
        for s in (self.params[i].storage for i in self.buffer_slots):
            if s.mirror is not None and s.mirror.device == self.device:
                s.host_current = False  # the forward pass advanced the mirror in place

    def inputs(self, sample: Sample) -> Sample:
        """``sample`` with its tensors on the runner's device (copies only where needed)."""
        return to_device(sample, self.device)

    # ------------------------------------------------------------ evaluation
    def loss(self, sample: Sample):
        """The loss of one item at the current parameters (buffers may advance): a
        floating-point scalar tensor, or a ``LossSum``."""
        s = self.inputs(sample)
        with self.binding("Runner.loss"):
            try:
                with self.autocast():
                    compiled = self.loop.compiled
                    if compiled is not None and torch.is_grad_enabled():
                        loss = compiled(s)  # compile=True (compiled.py)
                    else:
                        loss = self.loss_fn(call_model(self.module, s), loss_target(s))
            except MODEL_ERRORS as e:
                if is_compiler_error(e):
                    raise compiler_error(e) from e
                if isinstance(e, LeantrainError):
                    raise  # leantrain's own (a hook of a loop's), as it is
                raise DataError(f"Runner.loss: the model or loss rejected the sample ({describe(s)}): "
                                f"{str(e).splitlines()[0]}") from e
        return checked_loss("Runner.loss", loss)

    def update_buffers(self, sample: Sample) -> None:
        """Advance buffers (e.g. BatchNorm statistics) on ``sample``; train mode only."""
        sample = check_sample("Runner.update_buffers", sample)
        with self.binding("Runner.update_buffers") as bound:
            bound.advance_buffers("Runner.update_buffers", [sample], force=True)

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output at the current parameters (no gradients, buffers unchanged)."""
        with self.binding("Runner.predict") as bound, bound.scratch_buffers():
            with self.autocast():
                return self.module(to_device(x, self.device))

    def mean_loss(self, samples: Iterable[Sample]) -> float:
        """``(l1 + ... + ln) / n`` at the current parameters and mode (``LossSum``: totals over
        counts), reading ``samples`` one at a time; buffers and generators left as found."""
        return mean_loss(self, samples)

    def loss_and_gradients(
        self, sample: Sample, leaves: Sequence[Optional[torch.Tensor]]
    ) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
        """Loss and per-slot gradients of one item (``None`` at frozen slots); call it
        inside ``binding()`` with that binding's ``leaves``. A ``LossSum``'s total is
        differentiated; it comes back with its total detached."""
        loss = self.loss(sample)
        if isinstance(loss, LossSum):
            total, grads = self.loss_gradients(loss.total, leaves)
            return LossSum(total, loss.count), grads
        return self.loss_gradients(loss, leaves)

    def loss_gradients(self, loss: torch.Tensor, leaves) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
        """(the detached loss, per-slot gradients of ``loss`` for a binding's ``leaves``), dense
        in each leaf's layout (``backward.differentiate``), under the loop's loss scale."""
        bound = self.bound
        if self.reentrant is None and loss.requires_grad:
            self.reentrant = reentrant_checkpoint(loss)  # learned once, from the first graph
        return differentiate(loss, leaves, self.loop.loss_scale,
                             bound if bound is not None and bound.leaves is leaves else None,
                             force_public=self.loop.compiled is not None, reentrant=bool(self.reentrant))
