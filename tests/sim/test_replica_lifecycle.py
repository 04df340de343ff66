"""Replicas that start late (a scale-out) or come back after dying (a respawn) pay their cold start."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tidegate.policy.tiers import default_tiers
from tidegate.sim.fifo import FifoDispatcher
from tidegate.sim.harness import Harness, KillReplica, StartReplica
from tidegate.sim.scenarios import controller, mixed, replica_spec

COLD_START_S = 5.0


def _specs():
    return [replace(replica_spec(i), cold_start_s=COLD_START_S) for i in ("r0", "r1")]


def _dispatchers():
    return {"controller": controller(["r0", "r1"], default_tiers()),
            "fifo": FifoDispatcher(["r0", "r1"], default_tiers(), slot_limit=32)}


@pytest.mark.parametrize("kind", ["controller", "fifo"])
def test_a_replica_requested_later_serves_only_once_its_cold_start_is_over(kind: str) -> None:
    requests = mixed(6.0, 40.0, (("a", "standard", 1.0),), seed=2)
    result = Harness(_specs(), _dispatchers()[kind]).run(requests, events=[StartReplica(10.0, "r1")])
    on_r1 = [r.dispatch_s for r in result.records if r.replica_id == "r1"]
    assert on_r1 and min(on_r1) >= 10.0 + COLD_START_S
    assert not any(r.failure_reason for r in result.records)  # nothing was sent to it while down
    assert all(stats.alive for stats in result.replicas)


@pytest.mark.parametrize("kind", ["controller", "fifo"])
def test_a_killed_replica_started_again_is_back_after_its_cold_start(kind: str) -> None:
    requests = mixed(6.0, 60.0, (("a", "standard", 1.0),), seed=4)
    events = [KillReplica(10.0, "r1"), StartReplica(12.0, "r1")]
    result = Harness(_specs(), _dispatchers()[kind]).run(requests, events=events)
    back = [r.dispatch_s for r in result.records if r.replica_id == "r1" and r.dispatch_s >= 10.0]
    failed = [r for r in result.records if r.failure_reason]
    assert failed and all(r.dispatch_s < 10.0 for r in failed)  # only what it held when it died
    assert back and min(back) >= 12.0 + COLD_START_S
    assert result.replicas[1].alive


def test_starting_a_replica_that_serves_is_an_error() -> None:
    with pytest.raises(ValueError, match="already serving"):
        Harness(_specs(), _dispatchers()["fifo"]).run(mixed(2.0, 5.0, (("a", "standard", 1.0),), seed=1),
                                                       events=[StartReplica(1.0, "r0"), StartReplica(2.0, "r0")])


def test_storm_clients_resend_the_same_request_and_draw_the_same_next_ones_whatever_the_dispatcher() -> None:
    from tidegate.sim.harness import ClosedLoopClients
    from tidegate.sim.scenarios import chat

    clients = ClosedLoopClients(200, chat("storm", "standard"), 0.0, 5.0, seed=9)
    runs = {kind: Harness(_specs(), dispatcher).run((), clients=clients) for kind, dispatcher in _dispatchers().items()}
    ctl = runs["controller"].records
    refused = [r for r in ctl if r.refused_reason]
    assert refused  # 200 clients on 2 replicas: the controller refuses many
    last_sent: dict[tuple[int, int], float] = {}
    for record in ctl:
        key = (record.prompt_tokens, record.output_tokens)
        last_sent[key] = max(last_sent.get(key, 0.0), record.arrival_s)
    for record in refused:  # sent again, unless the storm ended first
        assert last_sent[(record.prompt_tokens, record.output_tokens)] > record.arrival_s or record.refused_s > 4.97

    def answered_lengths(records):  # the answered requests' lengths, as a multiset
        return sorted((r.prompt_tokens, r.output_tokens) for r in records if r.served)

    # both arms draw each client's requests from that client's own stream: they served the same work
    shared = set(answered_lengths(ctl)) & set(answered_lengths(runs["fifo"].records))
    assert len(shared) >= 0.8 * min(len(answered_lengths(ctl)), len(answered_lengths(runs["fifo"].records)))
