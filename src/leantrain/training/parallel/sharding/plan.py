"""Which rank owns which elements under sharding (ZeRO stages 1 and 2).

A shard plan is a pure function of the slot sizes, the alias map (frozen slots map to
``None``) and the world size, so every rank computes the same plan without talking.
Each representative slot is viewed flat and cut into at most one contiguous range per
rank, at multiples of ``ALIGN`` (64) elements: torch's fused and multi-tensor optimizer
kernels give an element the same bits wherever it sits as long as a cut falls on such a
multiple (``tests/parallel/test_sharding.py`` guards that rule against torch upgrades). A slot
of ``k`` blocks of 64 gives rank ``r`` the blocks ``[floor(r k / W), floor((r+1) k / W))``,
rotated by the slot's position ``k`` among the representatives, so that small slots
spread over the ranks (an empty slot: one empty range, on rank ``k mod W``). As an
option (``shard_by="slot"``) each slot goes whole to one rank instead: less even, but
clipping by norm under gradient sharding then has ``clip_grad_norm_``'s bits. Aliases share
their representative's cut; frozen slots and buffers are not cut (every rank keeps
them whole, as without sharding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ....errors import ConfigError

ALIGN = 64  # elements: cuts at multiples of this leave torch's optimizer kernels' bits alone
SHARDING_MODES = ("optimizer", "gradients", "parameters")
SHARD_BY = ("range", "slot")


@dataclass(frozen=True)
class Range:
    """Elements ``[start, stop)`` of slot ``slot`` (its flat view), owned by ``rank``."""

    slot: int
    start: int
    stop: int
    rank: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ShardPlan:
    """Every representative slot's ranges, in slot and offset order, for ``world`` ranks."""

    mode: str
    world: int
    sizes: tuple  # elements per slot
    slots_map: tuple  # the canonical map the plan was made for
    ranges: tuple  # Range, in slot order then offset order
    by: str = "range"  # "range": slots cut at multiples of 64; "slot": whole slots per rank

    def __post_init__(self) -> None:
        # Lookups every step makes, built once (the plan is read-only).
        by_rank: dict = {}
        for r in self.ranges:
            by_rank.setdefault(r.rank, []).append(r)
        object.__setattr__(self, "_owned", by_rank)
        object.__setattr__(self, "_at", {(r.slot, r.rank): r for r in self.ranges})

    def owned(self, rank: int) -> list[Range]:
        """The ranges ``rank`` updates, in slot order (at most one per slot)."""
        return list(self._owned.get(rank, ()))

    def range_of(self, slot: int, rank: int) -> Optional[Range]:
        """``rank``'s range of slot ``slot`` (an alias: its representative's), if any."""
        c = self.slots_map[slot]
        return None if c is None else self._at.get((c, rank))

    def with_aliases(self) -> "ShardPlan":
        """The plan with each alias slot given its representative's ranges too (for
        moving per-slot gradients, whose aliases hold their own shares)."""
        extra = [Range(j, r.start, r.stop, r.rank) for j, c in enumerate(self.slots_map)
                 if c is not None and c != j for r in self.ranges if r.slot == c]
        ranges = sorted(self.ranges + tuple(extra), key=lambda r: (r.slot, r.start))
        return ShardPlan(self.mode, self.world, self.sizes, self.slots_map, tuple(ranges), self.by)

    def elements(self, rank: int) -> int:
        """How many elements of optimizer state ``rank`` holds per state tensor kind."""
        return sum(r.size for r in self.owned(rank))


def plan_shards(mode: str, sizes: Sequence[int], slots_map: Sequence[Optional[int]], world: int,
                by: str = "range") -> ShardPlan:
    """The plan for slot ``sizes`` (elements), the canonical ``slots_map`` and ``world``;
    ``by="slot"``: each representative slot whole on one rank (the largest first, each to
    the rank holding the fewest elements so far, the lowest such rank on a tie)."""
    if mode not in SHARDING_MODES:
        raise ConfigError(f"sharding: expected one of {SHARDING_MODES} or None, got {mode!r}")
    if by not in SHARD_BY:
        raise ConfigError(f"sharding: shard_by must be one of {SHARD_BY}, got {by!r}")
    if not isinstance(world, int) or world < 1:
        raise ConfigError(f"sharding: the world size must be an integer >= 1, got {world!r}")
    reps = [i for i, c in enumerate(slots_map) if c == i]  # frozen slots and aliases are not cut of their own
    if by == "slot":
        load = [0] * world
        ranges = []
        for i in sorted(reps, key=lambda i: (-sizes[i], i)):
            r = min(range(world), key=lambda q: (load[q], q))
            ranges.append(Range(i, 0, sizes[i], r))
            load[r] += sizes[i]
        return ShardPlan(mode, world, tuple(sizes), tuple(slots_map), tuple(sorted(ranges, key=lambda r: r.slot)), by)
    ranges = []
    for k, i in enumerate(reps):  # k: the representative's position among the representatives
        n = sizes[i]
        if n == 0:  # an empty slot still has a history (its step count): one owner
            ranges.append(Range(i, 0, 0, k % world))
            continue
        blocks = -(-n // ALIGN)
        for r in range(world):
            p = (r - k) % world  # the rank's position in this slot's cut
            lo, hi = (p * blocks) // world * ALIGN, ((p + 1) * blocks) // world * ALIGN
            lo, hi = min(lo, n), min(hi, n)
            if hi > lo:
                ranges.append(Range(i, lo, hi, r))
    ranges.sort(key=lambda r: (r.slot, r.start))
    return ShardPlan(mode, world, tuple(sizes), tuple(slots_map), tuple(ranges), by)


def plan_for(mode: str, params, world: int, by: str = "range") -> ShardPlan:
    """The plan of a parameter list's current slots (sizes and alias map)."""
    return plan_shards(mode, [v.storage.host.numel() for v in params], params.canonical_slot_indices(), world, by)
