"""Replica choice: filter (health, breaker, slots, exclusions) then least outstanding, ties rotate."""

from __future__ import annotations

import ast
from pathlib import Path

from tidegate.policy.health import BreakerPolicy, CLOSED_BREAKER
from tidegate.policy.routing import ReplicaSnapshot, any_routable, pick_replica
from tidegate.types import ReplicaHealth, ReplicaLoad

OPEN = CLOSED_BREAKER.on_failure(0.0, 0.0, BreakerPolicy(failure_threshold=1, cooldown_s=10.0))


def _ids(replicas, choice):
    return None if choice.index is None else replicas[choice.index].replica_id


def test_picks_least_outstanding() -> None:
    replicas = [ReplicaSnapshot("a", outstanding=3), ReplicaSnapshot("b", outstanding=1)]
    assert _ids(replicas, pick_replica(replicas, 0.0, 0)) == "b"


def test_skips_unhealthy_replica() -> None:
    replicas = [ReplicaSnapshot("a", health=ReplicaHealth.UNHEALTHY), ReplicaSnapshot("b", outstanding=9)]
    assert _ids(replicas, pick_replica(replicas, 0.0, 0)) == "b"


def test_skips_replica_with_open_breaker_until_cooldown_ends() -> None:
    replicas = [ReplicaSnapshot("a", breaker=OPEN), ReplicaSnapshot("b", outstanding=9)]
    assert _ids(replicas, pick_replica(replicas, 1.0, 0)) == "b"
    assert _ids(replicas, pick_replica(replicas, 10.0, 0)) == "a"


def test_skips_full_replica() -> None:
    replicas = [ReplicaSnapshot("a", outstanding=2, slot_limit=2), ReplicaSnapshot("b", outstanding=5)]
    assert _ids(replicas, pick_replica(replicas, 0.0, 0)) == "b"


def test_no_free_slot_gives_no_choice() -> None:
    replicas = [ReplicaSnapshot("a", outstanding=2, slot_limit=2)]
    assert pick_replica(replicas, 0.0, 0).index is None


def test_full_replica_still_counts_as_routable() -> None:
    replicas = [ReplicaSnapshot("a", outstanding=2, slot_limit=2)]
    assert any_routable(replicas, 0.0)


def test_excluded_replica_is_not_picked() -> None:
    replicas = [ReplicaSnapshot("a"), ReplicaSnapshot("b", outstanding=4)]
    assert _ids(replicas, pick_replica(replicas, 0.0, 0, exclude={"a"})) == "b"


def test_tie_broken_by_kv_use_then_waiting() -> None:
    replicas = [
        ReplicaSnapshot("a", load=ReplicaLoad(kv_cache_usage=0.5)),
        ReplicaSnapshot("b", load=ReplicaLoad(kv_cache_usage=0.1, waiting_sequences=3)),
        ReplicaSnapshot("c", load=ReplicaLoad(kv_cache_usage=0.1, waiting_sequences=1)),
    ]
    assert _ids(replicas, pick_replica(replicas, 0.0, 0)) == "c"


def test_equal_replicas_rotate() -> None:
    replicas = [ReplicaSnapshot("a"), ReplicaSnapshot("b"), ReplicaSnapshot("c")]
    cursor, seen = 0, []
    for _ in range(3):
        choice = pick_replica(replicas, 0.0, cursor)
        seen.append(_ids(replicas, choice))
        cursor = choice.next_cursor
    assert sorted(seen) == ["a", "b", "c"]


def test_routing_and_health_import_no_clock_or_asyncio() -> None:
    policy_dir = Path(__file__).resolve().parents[2] / "src" / "tidegate" / "policy"
    for name in ("routing.py", "health.py"):
        tree = ast.parse((policy_dir / name).read_text())
        imported = {
            alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
        } | {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not imported & {"asyncio", "time"}, f"{name} imports {imported & {'asyncio', 'time'}}"
