"""Length classes: short and long prompts on separate replica sets (`policy.length_classes`)."""

from __future__ import annotations

import pytest

from tidegate.policy.length_classes import LengthClass, LengthClasses
from tidegate.policy.pool import PoolController, PoolReplica
from tidegate.policy.tiers import default_tiers
from tidegate.types import PoolRequest, ReplicaHealth

TIERS = default_tiers()
CLASSES = LengthClasses((LengthClass(1000, frozenset({"short0", "short1"})),
                         LengthClass(None, frozenset({"long0"}))))


def pool(classes: LengthClasses | None = CLASSES) -> PoolController:
    replicas = [PoolReplica(r, max_requests=8) for r in ("short0", "short1", "long0")]
    return PoolController(replicas, TIERS, length_classes=classes)


def send(ctl: PoolController, request_id: int, prompt_tokens: int, now_s: float = 0.0) -> str:
    """Where the request goes (at arrival or at the next capacity)."""
    decision = ctl.on_arrival(now_s, PoolRequest(request_id, now_s, "t", "standard", prompt_tokens, 50))
    if decision.assignment is not None:
        return decision.assignment.replica_id
    (assignment,) = ctl.on_capacity(now_s).assignments
    return assignment.replica_id


def test_a_request_goes_only_to_its_length_class_replicas() -> None:
    ctl = pool()
    short = {send(ctl, i, 200) for i in range(6)}
    long = {send(ctl, 100 + i, 4000) for i in range(4)}
    assert short == {"short0", "short1"} and long == {"long0"}
    assert ctl.length_class_fallbacks == 0


def test_without_classes_prompts_of_every_length_share_the_replicas() -> None:
    """The control for the test above: the same requests spread over the whole pool."""
    ctl = pool(None)
    assert {send(ctl, 100 + i, 4000) for i in range(4)} == {"short0", "short1", "long0"}


def test_a_prompt_at_a_class_bound_belongs_to_that_class() -> None:
    assert CLASSES.replicas_for(1000) == {"short0", "short1"}
    assert CLASSES.replicas_for(1001) == {"long0"}


def test_a_request_falls_back_to_the_whole_pool_when_its_class_is_down() -> None:
    ctl = pool()
    ctl.on_replica_health(0.0, "long0", ReplicaHealth.UNHEALTHY)
    assert send(ctl, 1, 4000) in {"short0", "short1"}
    assert ctl.length_class_fallbacks == 1


def test_a_full_class_waits_for_its_own_replicas() -> None:
    """Full is not down: the long prompt queues for its class rather than take a short replica."""
    ctl = PoolController([PoolReplica("short0", max_requests=4), PoolReplica("long0", max_requests=1)], TIERS,
                         length_classes=LengthClasses((LengthClass(1000, frozenset({"short0"})),
                                                       LengthClass(None, frozenset({"long0"})))))
    assert send(ctl, 1, 4000) == "long0"
    ctl.on_arrival(0.0, PoolRequest(2, 0.0, "t", "standard", 4000, 50))
    assert ctl.on_capacity(0.0).assignments == ()
    ctl.on_finish(1.0, 1)
    assert [a.replica_id for a in ctl.on_capacity(1.0).assignments] == ["long0"]


@pytest.mark.parametrize("classes, message", [
    ((), "at least one class"),
    ((LengthClass(1000, frozenset({"a"})),), "the last none"),
    ((LengthClass(None, frozenset({"a"})), LengthClass(None, frozenset({"b"}))), "every class but the last"),
    ((LengthClass(1000, frozenset({"a"})), LengthClass(500, frozenset({"a"})), LengthClass(None, frozenset({"b"}))),
     "strictly increasing"),
    ((LengthClass(1000, frozenset()), LengthClass(None, frozenset({"b"}))), "at least one replica"),
])
def test_bad_classes_are_refused_with_a_clear_error(classes: tuple[LengthClass, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LengthClasses(classes)


def test_classes_naming_a_replica_not_in_the_pool_are_refused() -> None:
    with pytest.raises(ValueError, match="not in the pool"):
        pool(LengthClasses((LengthClass(None, frozenset({"elsewhere"})),)))


def test_background_work_outside_a_request_s_class_is_not_preempted_for_it() -> None:
    """Rule 9 stops background work only where the waiting request could then go: a slot freed on a
    replica of another length class would be lost work and no help."""
    ctl = PoolController([PoolReplica("short0", max_requests=1), PoolReplica("long0", max_requests=1)], TIERS,
                         length_classes=LengthClasses((LengthClass(1000, frozenset({"short0"})),
                                                       LengthClass(None, frozenset({"long0"})))))
    background = ctl.on_arrival(0.0, PoolRequest(1, 0.0, "t", "batch", 200, 50, preemptible=True))
    assert background.replica_id == "short0"
    assert send(ctl, 2, 4000) == "long0"  # its class is full now
    ctl.on_arrival(1.0, PoolRequest(3, 1.0, "t", "critical", 4000, 50))
    dispatch = ctl.on_capacity(1.0)
    assert dispatch.preemptions == () and dispatch.assignments == ()
    assert ctl.held("short0") == 1
