"""Each item's random draws from a generator of its own (``item_seeds``, data parallel).

In one process the items of an update draw one after the other from the global
generator, so where item ``k``'s draws start depends on what items ``0..k-1`` drew: a
rank computing item ``k`` alone can only learn it by running their forwards (the replay,
``Binding.draw_states``: a no-gradient forward of every item on every rank). With item
seeds each update draws one number ``u`` from the run's CPU generator (every rank alike:
the generators agree) and item ``k``'s forward starts from generators seeded with a mix of
``u`` and ``k`` (CPU, and the device's): the same numbers wherever the item runs and on
any number of ranks, at the cost of that draw and a seeding per item. The run's
generators then continue from just after ``u``: what the model drew is not taken from
them, so what a loader or an augmentation draws next does not depend on the world size.
"""

from __future__ import annotations

import torch

from .binding import rng_state

_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def _mix(u: int, k: int) -> int:
    """SplitMix64 of ``u + (k + 1) * golden``: item ``k``'s seed, spread over 63 bits."""
    z = (u + (k + 1) * _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) >> 1


def seeded_states(device: torch.device, n: int) -> list:
    """The generator states ``n`` items start from, and after them the run's state once
    ``u`` is drawn (the list ``draw_states`` gives, but without a forward)."""
    u = int(torch.randint(0, 1 << 62, (), dtype=torch.int64))  # one draw of the CPU generator (host memory: no sync)
    after = rng_state(device)
    states = []
    for k in range(n):
        seed = _mix(u, k)
        cpu = torch.Generator().manual_seed(seed).get_state()
        cuda = torch.Generator(device=device).manual_seed(seed).get_state() if device.type == "cuda" else None
        states.append((cpu, cuda))
    states.append(after)
    return states
