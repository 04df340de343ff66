"""Tiers of criticality: which traffic waits, degrades and is shed first. Pure configuration.

Follows the criticality classes of Google SRE ("Handling Overload": CRITICAL_PLUS, CRITICAL,
SHEDDABLE_PLUS, SHEDDABLE) and of the Gateway API Inference Extension (critical / standard /
sheddable), plus `batch` for work that may wait long but must not starve. Each tier carries its own
queue bound, maximum queue wait and TTFT target (Triton's per-priority queue policy).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

__all__ = ["TierSpec", "TierTable", "default_tiers"]


@dataclass(frozen=True, slots=True)
class TierSpec:
    name: str
    rank: int  # 0 is served first; a larger rank waits behind smaller ranks and is shed first
    queue_bound: int  # most requests of this tier waiting in one queue
    max_queue_wait_s: float  # a request still queued this long after arrival is dropped
    ttft_target_s: float  # goodput counts a request whose time to first token is within this
    # Aging: a request of this tier competes with better-ranked tiers as if it had arrived this
    # much later, so it overtakes them after waiting this long; keeps `batch` from starving forever.
    # None: never overtakes (strict priority). The best tier needs none.
    aging_offset_s: float | None = None
    # Load pressure (predicted wait / max wait) at which this tier is degraded rather than queued;
    # sheddable tiers get a lower threshold, so they degrade first.
    degrade_at_pressure: float = 1.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a tier needs a name")
        if self.rank < 0 or self.queue_bound < 0:
            raise ValueError(f"tier {self.name}: rank and queue_bound must be >= 0")
        if self.max_queue_wait_s <= 0 or self.ttft_target_s <= 0:
            raise ValueError(f"tier {self.name}: max_queue_wait_s and ttft_target_s must be > 0")
        if (self.aging_offset_s is not None and self.aging_offset_s < 0) or self.degrade_at_pressure <= 0:
            raise ValueError(f"tier {self.name}: aging_offset_s >= 0 and degrade_at_pressure > 0")


class TierTable:
    """The configured tiers, looked up by name, iterated best rank first."""

    def __init__(self, tiers: Iterable[TierSpec], *, default_tier: str) -> None:
        ordered = sorted(tiers, key=lambda tier: tier.rank)
        self._by_name = {tier.name: tier for tier in ordered}
        if len(self._by_name) != len(ordered):
            raise ValueError("tier names must be unique")
        if len({tier.rank for tier in ordered}) != len(ordered):
            raise ValueError("tier ranks must be unique: strict priority needs a total order")
        if default_tier not in self._by_name:
            raise ValueError(f"default tier {default_tier!r} is not a configured tier")
        self._ordered = tuple(ordered)
        self.default = self._by_name[default_tier]
        self.best = ordered[0]  # the first rank: the tier protected under load

    def __getitem__(self, name: str) -> TierSpec:
        return self._by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[TierSpec]:
        return iter(self._ordered)

    def __len__(self) -> int:
        return len(self._ordered)

    def get(self, name: str | None) -> TierSpec:
        """The named tier, or the default tier when no name is given."""
        return self.default if name is None else self._by_name[name]


def default_tiers() -> TierTable:
    # Each interactive tier's maximum wait sits below its TTFT target: a request that waited longer
    # would be served too late to count, so it is better answered at once (or degraded).
    return TierTable(
        (
            TierSpec("critical", rank=0, queue_bound=1000, max_queue_wait_s=2.5, ttft_target_s=3.0),
            TierSpec("standard", rank=1, queue_bound=1000, max_queue_wait_s=4.0, ttft_target_s=5.0,
                     aging_offset_s=60.0, degrade_at_pressure=0.9),
            TierSpec("sheddable", rank=2, queue_bound=500, max_queue_wait_s=8.0, ttft_target_s=10.0,
                     aging_offset_s=120.0, degrade_at_pressure=0.5),
            TierSpec("batch", rank=3, queue_bound=5000, max_queue_wait_s=3600.0, ttft_target_s=600.0,
                     aging_offset_s=300.0, degrade_at_pressure=1.0),
        ),
        default_tier="standard",
    )
