"""What a body does to move its fleet to the desired count, with warm standbys. Pure: counts in,
actions out; the live actuator (`gateway.scaling.LocalActuator`) and the simulator
(`sim.scaling.ScalingLoop`) carry them out the same way.

A standby is a replica loaded and out of traffic: a scale-out promotes standbys first (they serve
within seconds instead of a cold start), then starts stopped replicas; standbys promoted are
refilled in the background, and a replica drained by a scale-in is kept as the standby when one
is missing rather than stopped and another started
(`tests/policy/test_fleet.py::test_a_drained_replica_refills_the_standby_before_a_new_one_starts`).
A scale-in drains (no request aborted) and never the last serving replica.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FleetCounts", "FleetActions", "fleet_actions"]


@dataclass(frozen=True, slots=True)
class FleetCounts:
    serving: int  # taking traffic
    starting: int  # started to serve, not ready yet
    standby: int  # loaded, out of traffic: promotable now
    warming: int  # loading to become a standby
    standby_target: int  # standbys to keep


@dataclass(frozen=True, slots=True)
class FleetActions:
    promote: int = 0  # standbys to put in traffic
    start: int = 0  # stopped replicas to start serving (a cold start)
    drain: int = 0  # serving replicas to drain
    keep_drained: int = 0  # of those drained, kept loaded as standbys once empty
    warm: int = 0  # stopped replicas to load as standbys


def fleet_actions(desired: int, counts: FleetCounts) -> FleetActions:
    """The actions that take the fleet (serving + starting) to `desired` and keep the standbys."""
    fleet = counts.serving + counts.starting
    promote = start = drain = 0
    if desired > fleet:
        promote = min(desired - fleet, counts.standby)
        start = desired - fleet - promote
    elif desired < fleet:
        drain = min(fleet - desired, max(0, counts.serving - 1))  # never the last serving replica
    missing = max(0, counts.standby_target - (counts.standby - promote + counts.warming))
    keep = min(drain, missing)
    return FleetActions(promote, start, drain, keep, missing - keep)
