"""How many requests background (batch) work may hold in a pool now: the pool's level slots less
the interactive traffic's mean demand over a memory window, never below 0. Pure: time and the
measurements come in as arguments, the memory goes out as a new value.

Why a mean and not the demand of the moment: engines do not preempt, so a batch request sent into a
lull holds its slot for its whole run; sized by the instant demand, batch would fill every lull
between two interactive bursts and meet the next burst in the slots. Sized by the demand of the last
`memory_s`, it fills what the interactive traffic leaves idle on average, and shrinks as a surge
builds. (`bench/batch_api.py`'s protection bar; `test_batch_takes_what_interactive_leaves_on_average`.)
Level slots, not the whole engine: rule 5's headroom of each replica is for better tiers only
(`policy.pool`), so batch never counts on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DemandMemory", "remember_demand", "background_slots"]


@dataclass(frozen=True, slots=True)
class DemandMemory:
    """The interactive demand's mean (requests held at replicas or waiting), as of `at_s`."""

    mean: float = 0.0
    at_s: float | None = None  # None: nothing seen yet


def remember_demand(memory: DemandMemory, now_s: float, demand: float, memory_s: float) -> DemandMemory:
    """The mean with `demand`, held since the last sample, folded in: an exponential mean whose
    weights halve every `memory_s * ln 2` (time-weighted, so irregular samples count by duration);
    `memory_s` 0 remembers only the last sample."""
    if memory.at_s is None or memory_s <= 0:
        return DemandMemory(float(demand), now_s)
    elapsed_s = max(0.0, now_s - memory.at_s)
    kept = math.exp(-elapsed_s / memory_s)
    return DemandMemory(kept * memory.mean + (1 - kept) * demand, now_s)


def background_slots(level_slots: int, memory: DemandMemory) -> int:
    """Requests batch work may hold: the level slots less the mean demand (rounded up, so a fraction
    of demand keeps a whole slot), never below 0."""
    return max(0, level_slots - math.ceil(memory.mean - 1e-9))
