"""Records that cross boundaries between policies, runtime and simulator. Frozen, units in names.

Add records here when two packages must agree on them; keep records private to a package
inside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["ReplicaHealth", "ReplicaLoad"]


class ReplicaHealth(Enum):
    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What a replica reports about itself (engine /metrics, vLLM metrics), read by routing."""

    running_sequences: int = 0
    waiting_sequences: int = 0
    kv_cache_usage: float = 0.0  # fraction 0-1 of KV-cache capacity in use
