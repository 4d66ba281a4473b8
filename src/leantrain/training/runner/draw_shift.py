"""Where each item's random draws start, without running the other items' forwards.

In one process the items of an update draw one after the other from the global
generators, so item ``k`` starts where items ``0..k-1`` left them. A rank computing item
``k`` alone needs that state. The forward's draws are counted once: for a model whose
number of draws is fixed by its inputs' shapes (dropout, ``randn_like``, ``bernoulli``:
every op whose output shape is fixed by the input's), every item of one shape moves the
generators by the same amount, so item ``k``'s start is the update's start moved ahead by
the shifts of items ``0..k-1``, computed without the model:

* torch's CPU generator (MT19937) is moved ahead by drawing the counted number of 32-bit
  words into a scratch buffer (``random_`` on ``int32`` draws exactly one word per element);
* a CUDA generator (Philox) takes the counted offset directly (``seed``, ``offset``).

The shift of an item shape is learned from one no-gradient forward of the first item
of that shape (``measure``), and checked at every item a rank then runs (``Start.then``):
a forward that draws another amount for the same shapes (the values decide) is a
``DataError`` naming the item, never other numbers silently. A forward that leaves
torch's cached normal sample valid (``randn`` of fewer than 16 values) cannot be moved
ahead by counting words; neither can a generator state this torch lays out otherwise:
those forwards are replayed (``Binding.draw_states``), as the caller says once.
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass
from typing import Optional

import numpy
import torch

_N = 624  # MT19937's words per block
_HEAD = 24  # torch's CPU state: seed (u64), left (i32), seeded (i32), next (u64), then the 624 words (u64 each)
_SIZE = _HEAD + 8 * _N + 40  # ... then the cached normal samples (double x, y, rho; valid; float sample; valid)
_CHUNK = 1 << 16  # words drawn per call when moving ahead (a 256 KiB scratch buffer)
MAX_WORDS = 1 << 28  # a forward drawing more is replayed (counting it takes about a second per 2^25)


@dataclass(frozen=True)
class Shift:
    """How far one item's forward moves the generators: ``words`` 32-bit words of the CPU
    generator and ``offset`` of the device's Philox generator (``None`` without one)."""

    words: int
    offset: Optional[int] = None

    @property
    def zero(self) -> bool:
        return self.words == 0 and not self.offset


def rng_state(device: torch.device):
    """The generators a forward on ``device`` may draw from (CPU, and the device's)."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def same_rng(a, b) -> bool:
    """Whether two ``rng_state`` results are the same states."""
    return torch.equal(a[0], b[0]) and ((a[1] is None) == (b[1] is None)) and (a[1] is None or torch.equal(a[1], b[1]))


def set_rng_state(device: torch.device, state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def _position(cpu: torch.Tensor) -> tuple[int, numpy.ndarray, bytes]:
    """The CPU state's index into its block, its 624 words, and the cached normals."""
    raw = cpu.numpy().tobytes()
    left, _, nxt = struct.unpack_from("<iiQ", raw, 8)
    words = numpy.frombuffer(raw, dtype=numpy.uint64, count=_N, offset=_HEAD)
    index = _N if left == 1 else nxt  # left == 1: the next draw regenerates the block
    return index, words, raw[_HEAD + 8 * _N:]


def _plain(cpu: torch.Tensor) -> bool:
    """A CPU state this module can move ahead: torch's layout, no cached normal sample."""
    if cpu.dtype != torch.uint8 or cpu.numel() != _SIZE:
        return False
    rest = cpu.numpy().tobytes()[_HEAD + 8 * _N:]
    return rest[24] == 0 and rest[36] == 0  # the double and the float normal caches invalid


def _moved(cpu: torch.Tensor, words: int, scratch: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The CPU state ``words`` 32-bit draws after ``cpu`` (no global generator touched)."""
    if words == 0:
        return cpu
    g = torch.Generator()
    g.set_state(cpu)
    if scratch is None:
        scratch = torch.empty(min(words, _CHUNK), dtype=torch.int32)
    left = words
    while left:
        take = min(left, scratch.numel())
        scratch[:take].random_(generator=g)  # one 32-bit word an element, in order
        left -= take
    return g.get_state()


def _words_between(before: torch.Tensor, after: torch.Tensor) -> Optional[int]:
    """How many 32-bit words lead from ``before`` to ``after``, or ``None`` (more than
    ``MAX_WORDS``, or not the same stream). Walks the blocks: one regeneration a step."""
    i0, _, _ = _position(before)
    i1, w1, _ = _position(after)
    g = torch.Generator()
    g.set_state(before)
    block = torch.empty(_N, dtype=torch.int32)
    lead = (i1 - i0) % _N
    if lead:
        block[:lead].random_(generator=g)
    count = lead
    while count <= MAX_WORDS:
        index, words, _ = _position(g.get_state())
        if index % _N == i1 % _N and numpy.array_equal(words, w1):
            return count
        block.random_(generator=g)
        count += _N
    return None


def _offset(cuda: torch.Tensor) -> tuple[int, int]:
    seed, offset = struct.unpack_from("<Qq", cuda.numpy().tobytes(), 0)
    return seed, offset


def _with_offset(cuda: torch.Tensor, offset: int) -> torch.Tensor:
    raw = bytearray(cuda.numpy().tobytes())
    struct.pack_into("<q", raw, 8, offset)
    return torch.frombuffer(raw, dtype=torch.uint8).clone()


def measure(before: tuple, after: tuple) -> Optional[Shift]:
    """The shift from ``before`` to ``after`` (``rng_state`` pairs around one forward), or
    ``None`` where it cannot be applied by counting (see the module's docstring)."""
    cpu0, cuda0 = before
    cpu1, cuda1 = after
    if not (_plain(cpu0) and _plain(cpu1)):
        return None
    words = 0 if torch.equal(cpu0, cpu1) else _words_between(cpu0, cpu1)
    if words is None or not torch.equal(_moved(cpu0, words), cpu1):  # the count checked by moving
        return None
    offset = None
    if cuda0 is not None:
        if cuda0.numel() != 16 or cuda1 is None or cuda1.numel() != 16:
            return None
        (seed0, off0), (seed1, off1) = _offset(cuda0), _offset(cuda1)
        if seed0 != seed1 or off1 < off0:
            return None
        offset = off1 - off0
    return Shift(words, offset)


class Plan:
    """Each item's start state and, after the last, where one process ends the update: the
    sequence ``Binding.draw_states`` fills by replaying, computed by moving ahead instead,
    in order and only as far as asked (``plan[k]`` moves up to state ``k``). Indexing gives
    an item's ``Start``, slicing a view (``plan[:-1]``, a rank's ``[rank::world]``). (A
    thread computing the states beside the rank's forwards was measured: on a machine whose
    cores the ranks already fill it was no faster, and its interpreter lock traffic slowed
    the ranks' Python; on CUDA there is nothing to compute.)"""

    def __init__(self, op: str, start: tuple, shifts: list[Shift]) -> None:
        self.op = op
        self.shifts = shifts
        self.states: list = [tuple(start)]
        most = max((s.words for s in shifts), default=0)
        self.scratch = torch.empty(max(1, min(most, _CHUNK)), dtype=torch.int32) if most else None

    def state(self, k: int) -> tuple:
        """State ``k`` (``rng_state``'s pair), moving ahead to it if not yet there."""
        while len(self.states) <= k:
            cpu, cuda = self.states[-1]
            shift = self.shifts[len(self.states) - 1]
            cpu = _moved(cpu, shift.words, self.scratch)
            if cuda is not None:
                cuda = _with_offset(cuda, _offset(cuda)[1] + (shift.offset or 0))
            self.states.append((cpu, cuda))
        return self.states[k]

    def __len__(self) -> int:
        return len(self.shifts) + 1

    def __getitem__(self, k):
        return _View(self, range(len(self)))[k]


class _View:
    """Some of a plan's positions, in order (what slicing a plan gives)."""

    def __init__(self, plan: Plan, indices: range) -> None:
        self.plan, self.indices = plan, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return _View(self.plan, self.indices[k])
        i = self.indices[k]
        return Start(self.plan, i) if i < len(self.plan) - 1 else self.plan.state(i)


class Start:
    """Item ``k``'s start: unpacks as ``rng_state``'s pair (``cpu, cuda = start``, waiting for
    it); ``then``: where the item's forward must leave the generators (the next start);
    ``op``: the call."""

    __slots__ = ("plan", "k")

    def __init__(self, plan: Plan, k: int) -> None:
        self.plan, self.k = plan, k

    def __iter__(self):
        return iter(self.plan.state(self.k))

    def __getitem__(self, i: int) -> Optional[torch.Tensor]:
        return self.plan.state(self.k)[i]

    @property
    def then(self) -> tuple:
        return self.plan.state(self.k + 1)

    @property
    def op(self) -> str:
        return self.plan.op


def starts(op: str, start: tuple, shifts: list[Shift]) -> Plan:
    """Each item's ``Start`` (``shifts[k]``: item ``k``'s draws) and, after them, the state one
    process ends the update in (a ``Plan``)."""
    return Plan(op, start, shifts)


def signature(sample) -> tuple:
    """What fixes a forward's number of draws: each tensor's shape, dtype and device, and
    every other leaf's value (a length, a flag)."""
    leaves = torch.utils._pytree.tree_leaves(sample)
    return tuple((tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor)
                 else (type(x).__name__, x if isinstance(x, (int, float, bool, str, type(None))) else id(type(x)))
                 for x in leaves)


MAX_SHAPES = 256  # item shapes whose draws are counted; past them, the replay
_UNSEEN = object()


def item_starts(bound, op: str, batch) -> Optional[Plan]:
    """For a ``Binding`` (``bound``): the generator state each item of ``batch`` starts
    from in one process, and after the last, without running the items' forwards: the
    update's start moved ahead by each earlier item's counted draws, each item shape
    counted once by one no-gradient forward (``_counted``). Where a forward's draws cannot
    be counted, the replay (``Binding.draw_states``), said once. ``None`` once a forward
    is seen to draw nothing."""
    runner = bound.runner
    if runner.draws is False:
        return None
    shifts = []
    for sample in batch:
        sig = signature(sample)
        shift = runner.draw_shifts.get(sig, _UNSEEN)
        if shift is _UNSEEN:
            if len(runner.draw_shifts) >= MAX_SHAPES:
                return _replayed(bound, op, batch, f"more than {MAX_SHAPES} item shapes were counted")
            shift = runner.draw_shifts[sig] = _counted(bound, op, sample)
            if runner.draws is False:
                return None
        if shift is None:
            return _replayed(bound, op, batch, "a forward's draws cannot be counted (it leaves torch's cached "
                                               "normal sample behind, as randn of fewer than 16 values does, "
                                               f"or draws more than {MAX_WORDS} words)")
        shifts.append(shift)
    return starts(op, rng_state(runner.device), shifts)


def _counted(bound, op: str, sample) -> Optional[Shift]:
    """One no-gradient forward of ``sample`` (buffers left as they are, the generators put
    back): how far it moves the generators, or ``None`` (not countable)."""
    runner = bound.runner
    before = rng_state(runner.device)
    try:
        with torch.no_grad(), bound.scratch_buffers():
            bound._forward(op, sample)
        after = rng_state(runner.device)
    finally:
        set_rng_state(runner.device, before)
    runner.counted_draw_forward()
    if not runner.learned_draws([before, after]):
        return Shift(0, 0 if after[1] is not None else None)
    return measure(before, after)


def _replayed(bound, op: str, batch, why: str) -> Optional[list]:
    """The replay, the first time with a warning saying why."""
    if not bound.runner.replay_said:
        bound.runner.replay_said = True
        warnings.warn(f"{op}: every rank runs a no-gradient forward of every item of each update to draw the "
                      f"random numbers one process draws: {why}. The bits are one process's; the cost is up to "
                      f"one forward per item (item_seeds=True seeds each item instead)", stacklevel=3)
    return bound.draw_states(op, batch)
