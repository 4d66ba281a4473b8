"""One call's view of the module: what it reads, which leaves are differentiated, and
how buffers advance, all undone when the call ends.

The module belongs to the user. Between calls it holds its own Parameter and buffer
objects, its ties as written. For the length of one call (a step, a loss, a
prediction) a ``Binding`` puts, at the few locations that need it:

* the storage's device mirror, when the runner computes on another device;
* a fresh leaf over the same memory, at the second and later occurrences of a tied
  Parameter (each occurrence then gets its own gradient, summed in slot order);
* a detached view, at a frozen slot whose tensor would otherwise pass a gradient;
* a device copy of a non-persistent buffer that lives elsewhere.

Everywhere else the module's own tensors are used and differentiated directly, so a
model without ties or mirrors costs no binding at all. ``__exit__`` puts the
originals back, even when the call raised.

Buffers (spec §7.1): in train mode every item's forward first advances the buffers
(``advance_buffers``), then the items are differentiated against scratch copies of
the advanced buffers (``scratch_buffers``), so the gradient passes leave them as the
buffer pass left them. The buffer pass replays the random number generators: item
k's buffer forward and gradient forward draw the same numbers (the same dropout
mask), and a step consumes the generators exactly as one plain forward per item.
Whether the model writes any buffer at all is learned, not assumed: until a
forward is seen writing one (a version counter moved, or a buffer was reassigned),
a step skips the buffer pass and differentiates against scratch copies; if the
scratch was written, the step is redone with the pass (the real buffers were not
touched, the generators replay). So a model whose buffers never change never pays
an extra forward, and a model that does pays it once, on its first step.
"""

from __future__ import annotations

import contextlib
import random
from typing import Any, Optional, Protocol, Sequence

import numpy
import torch

from .backward import all_plain
from .draw_shift import item_starts, rng_state, same_rng, set_rng_state  # noqa: F401 (the generators' states, here too)
from ...errors import ConfigError, DataError, LeantrainError, slot_label
from ...params.dense import kernel_strides
from ...params.module_slots import bind
from ...samples import call_model, describe

MODEL_ERRORS = (RuntimeError, ValueError, TypeError, IndexError)


@contextlib.contextmanager
def rng_preserved(device: torch.device, generators: Sequence[torch.Generator] = ()):
    """Run a block that must not consume the caller's randomness (a measuring pass, an
    evaluation): every global generator a collate or transform may draw from (torch's,
    CUDA's, Python's ``random``, NumPy's) and ``generators`` are put back as they were."""
    saved = rng_state(device)
    py, np_state = random.getstate(), numpy.random.get_state()
    own = [(g, g.get_state()) for g in generators]
    try:
        yield
    finally:
        set_rng_state(device, saved)
        random.setstate(py)
        numpy.random.set_state(np_state)
        for g, s in own:
            g.set_state(s)


class Owner(Protocol):
    """What a ``Binding`` reads of the runner it binds (the Runner is one; nothing here
    imports it). What a binding observes about the model (that a forward wrote a buffer,
    that it drew random numbers) it reports through the ``learned_*`` methods; the
    runner keeps the facts."""

    module: torch.nn.Module
    params: Any
    locations: list
    buffer_slots: list
    device: torch.device
    buffer_writes: Optional[bool]
    draws: Optional[bool]
    draw_shifts: dict
    replay_said: bool

    @property
    def has_buffer_updates(self) -> bool: ...
    def inputs(self, sample): ...
    def autocast(self): ...
    def loss_and_gradients(self, sample, leaves): ...
    def mark_buffers_stale(self) -> None: ...
    def learned_buffer_writes(self, wrote: bool) -> None: ...
    def learned_draws(self, states: list) -> bool: ...
    def counted_draw_forward(self) -> None: ...
    def entered(self, binding: Optional["Binding"]) -> None: ...


class BufferSnapshot:
    """Buffers as they were before a step's buffer pass (values and whether each
    storage's host copy was current), to undo a rejected step."""

    __slots__ = ("pairs", "flags", "written")

    def __init__(self, tensors: Sequence[torch.Tensor], storages: Sequence = ()) -> None:
        self.pairs = [(t, t.clone()) for t in tensors]
        self.flags = [(s, s.host_current) for s in storages]
        self.written: list[torch.Tensor] = []  # floating buffers the pass changed

    def restore(self) -> None:
        with torch.no_grad():
            for t, old in self.pairs:
                t.copy_(old)
        for s, flag in self.flags:
            s.host_current = flag

    def restore_where(self, found: torch.Tensor) -> None:
        """Undo on the device where ``found`` (a one-element flag) is set; no host read."""
        keep = found[0] == 0
        with torch.no_grad():
            for t, old in self.pairs:
                torch.where(keep, t, old, out=t)


class Binding:
    """The module bound for one call. Use as a context; re-entrant within one runner."""

    __slots__ = ("runner", "leaves", "working", "swaps", "depth", "wrt", "plain", "strides")

    def __init__(self, runner: Owner, leaves: list, working: list, swaps: list) -> None:
        self.runner = runner
        self.leaves: list[Optional[torch.Tensor]] = leaves  # one per trainable slot
        self.wrt = tuple(t for t in leaves if t is not None)  # what a gradient pass differentiates
        self.plain = all_plain(self.wrt)
        self.strides = tuple(kernel_strides(t) for t in self.wrt)  # the layout each gradient is brought to
        self.working: list[torch.Tensor] = working  # what the module reads at each slot
        self.swaps = swaps  # (location, bound tensor, original)
        self.depth = 0

    def __enter__(self) -> "Binding":
        if self.depth == 0:
            for loc, t, _ in self.swaps:
                bind(loc, t)
            self.runner.entered(self)
        self.depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.runner.entered(None)
            for loc, _, orig in reversed(self.swaps):
                bind(loc, orig)

    # ---------------------------------------------------------------- buffers
    def _forward(self, op: str, sample) -> None:
        """One no-gradient forward of ``sample`` as the step runs it (device, autocast); a
        model error is a ``DataError`` naming the sample's shapes."""
        runner = self.runner
        s = runner.inputs(sample)
        try:
            with runner.autocast():
                call_model(runner.module, s)
        except MODEL_ERRORS as e:
            if isinstance(e, LeantrainError):
                raise  # leantrain's own (a hook of a loop's: a refused read, a failed gather), as it is
            raise DataError(f"{op}: the model rejected the sample ({describe(s)}): {str(e).splitlines()[0]}") from e

    def _buffers(self) -> list[tuple[int, torch.Tensor]]:
        return [(i, self.working[i]) for i in self.runner.buffer_slots]

    def _adopt_reassigned(self, op: str, bufs, bound: Sequence[torch.Tensor]) -> bool:
        """A forward that *assigned* a new tensor to a buffer (``self.b = self.b + 1``)
        wrote it: copy the value into the tensor bound there and bind that again."""
        runner, wrote = self.runner, False
        for (i, _), t in zip(bufs, bound):
            loc = runner.locations[i]
            new = loc.current()
            if new is t:
                continue
            if not isinstance(new, torch.Tensor) or new.shape != t.shape or new.dtype != t.dtype:
                got = "nothing" if new is None else f"{tuple(new.shape)} {new.dtype}"
                raise ConfigError(
                    f"{op}: {slot_label(i, runner.params[i].name)}: the model replaced this "
                    f"buffer during forward with {got}; expected {tuple(t.shape)} {t.dtype}"
                )
            with torch.no_grad():
                t.copy_(new)
            bind(loc, t)
            wrote = True
        return wrote

    def advance_buffers(
        self, op: str, batch: Sequence, force: bool = False, states: Optional[list] = None, probe: bool = False,
        seeded: bool = False,
    ) -> tuple[bool, Optional[BufferSnapshot]]:
        """The buffer pass: one no-gradient forward per item, in order (train mode).

        Returns whether the pass ran, and a snapshot of the buffers before it when it
        changed any (``None`` otherwise). Runs once the model is known to write buffers,
        with ``probe`` until that is known (the loop's reduction says so where several ranks
        compute an update: every rank runs every item, so every rank learns the same), or
        when ``force``d. A model error restores the buffers and the generators and raises.
        ``states``: a list that receives the generators' state before each item and after
        the last (what data parallel needs to draw each item's numbers, see ``draw_states``);
        with ``seeded``, the states each item starts from, given (``item_seeds.py``).
        """
        runner = self.runner
        if not runner.has_buffer_updates or not (
            force or runner.buffer_writes or (probe and runner.buffer_writes is None)
        ):
            return False, None
        bufs = self._buffers()
        tensors = [t for _, t in bufs]
        snapshot = BufferSnapshot(tensors, [runner.params[i].storage for i, _ in bufs])
        versions = [t._version for t in tensors]
        rng = rng_state(runner.device)
        reassigned = False
        try:
            with torch.no_grad():
                for k, sample in enumerate(batch):
                    if seeded:
                        set_rng_state(runner.device, states[k])
                    elif states is not None:
                        states.append(rng_state(runner.device))
                    self._forward(op, sample)
                    reassigned |= self._adopt_reassigned(op, bufs, tensors)
        except BaseException:
            snapshot.restore()
            set_rng_state(runner.device, rng)
            raise
        if states is not None and not seeded:
            states.append(rng_state(runner.device))
        set_rng_state(runner.device, rng)  # replay: the gradient passes draw the same numbers
        written = [t for t, v in zip(tensors, versions) if t._version != v]
        runner.learned_buffer_writes(bool(written or reassigned))  # every rank ran every item: all learn alike
        if not written:
            return True, None
        runner.mark_buffers_stale()
        snapshot.written = [t for t in written if t.is_floating_point()]
        return True, snapshot

    def draw_states(self, op: str, batch: Sequence) -> Optional[list]:
        """The generators' state before each item's forward and after the last, as one
        process runs the items in order (a no-gradient forward per item, buffers left as
        they are), so that a rank computing item ``k`` draws item ``k``'s numbers (dropout
        masks) wherever it runs. ``None`` once a forward is seen to draw nothing (then
        there is nothing to line up and the pass is never run again)."""
        runner = self.runner
        if runner.draws is False:
            return None
        states: list = [rng_state(runner.device)]
        try:
            with torch.no_grad(), self.scratch_buffers():
                for sample in batch:
                    self._forward(op, sample)
                    states.append(rng_state(runner.device))
        finally:
            set_rng_state(runner.device, states[0])  # the gradient passes draw from here
        return states if runner.learned_draws(states) else None

    def draws_numbers(self, op: str, batch: Sequence) -> bool:
        """Whether the model's train-mode forward draws random numbers, learned once from a
        no-gradient forward of the batch's first item (every rank runs the same item, so
        every rank learns alike); nothing else moves."""
        if self.runner.draws is None:
            self.draw_states(op, batch[:1])
        return bool(self.runner.draws)

    def item_states(self, op: str, batch: Sequence, recorded: Optional[list]) -> Optional[list]:
        """Each item's generator states for a step that needs them: those the buffer pass
        ``recorded``, else counted (``draw_shift.item_starts``); ``None`` when the model draws nothing."""
        if recorded is None:
            return item_starts(self, op, batch)
        return recorded if self.runner.learned_draws(recorded) else None

    def one_item(self, op: str, sample) -> tuple[torch.Tensor, list, Optional[BufferSnapshot]]:
        """One item in train mode as plain PyTorch runs it: one forward on the real
        buffers, which advances them and builds the graph, then its gradients (a
        forward that reads the buffers it writes, such as ``spectral_norm``'s power
        iteration, then runs once, as in ``loss.backward(); opt.step()``).

        Returns (loss, gradients, a snapshot of the buffers before the forward when it
        wrote any, else ``None``). A model error restores the buffers and raises."""
        runner = self.runner
        bufs = self._buffers()
        tensors = [t for _, t in bufs]
        snapshot = BufferSnapshot(tensors, [runner.params[i].storage for i, _ in bufs])
        versions = [t._version for t in tensors]
        try:
            loss, grads = runner.loss_and_gradients(sample, self.leaves)
            reassigned = self._adopt_reassigned(op, bufs, tensors)
        except BaseException:
            for (i, _), t in zip(bufs, tensors):
                bind(runner.locations[i], t)  # a buffer the failed forward assigned
            snapshot.restore()
            raise
        written = [t for t, v in zip(tensors, versions) if t._version != v]
        runner.learned_buffer_writes(bool(written) or reassigned)
        if not written:
            return loss, grads, None
        runner.mark_buffers_stale()
        snapshot.written = [t for t in written if t.is_floating_point()]
        return loss, grads, snapshot

    def scratch_buffers(self) -> "_Scratch":
        """A context in which the module's buffers are scratch copies (train mode), so
        forward passes leave the real buffers as they are; ``.written`` tells afterwards
        whether the model wrote any. Free when no buffer can move."""
        return _Scratch(self) if self.runner.has_buffer_updates else _NO_SCRATCH


class _Scratch:
    """Scratch copies of the buffers, bound for the gradient passes (train mode)."""

    __slots__ = ("binding", "bufs", "copies", "versions", "written")

    def __init__(self, binding: Binding) -> None:
        self.binding, self.written = binding, False
        runner = binding.runner
        self.bufs = binding._buffers() if runner.has_buffer_updates else []
        self.copies: list[torch.Tensor] = []
        self.versions: list[int] = []

    def __enter__(self) -> "_Scratch":
        locs = self.binding.runner.locations
        self.copies = [t.clone() for _, t in self.bufs]
        for (i, _), c in zip(self.bufs, self.copies):
            bind(locs[i], c)
        self.versions = [0] * len(self.copies)
        return self

    def _note_writes(self) -> None:
        locs = self.binding.runner.locations
        for (i, _), c, v in zip(self.bufs, self.copies, self.versions):
            if c._version != v or locs[i].current() is not c:
                self.written = True

    def reset(self) -> None:
        """Before the next item: the scratch buffers again hold the fully advanced
        values, so every item is differentiated against the same buffers (only for a
        model that writes buffers; a copy per buffer)."""
        if not self.bufs or not self.binding.runner.buffer_writes:
            return
        self._note_writes()
        locs = self.binding.runner.locations
        with torch.no_grad():
            for (i, t), c in zip(self.bufs, self.copies):
                c.copy_(t)
                bind(locs[i], c)
        self.versions = [c._version for c in self.copies]

    def __exit__(self, *exc) -> None:
        self._note_writes()
        locs = self.binding.runner.locations
        for (i, t), c in zip(self.bufs, self.copies):
            bind(locs[i], t)


class _NoScratch:
    """The scratch context when no buffer can move (eval mode, or no buffer slots)."""

    written = False

    def __enter__(self) -> "_NoScratch":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def reset(self) -> None:
        return None


_NO_SCRATCH = _NoScratch()
