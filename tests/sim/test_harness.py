"""Scenario runs through the FIFO dispatcher: reproducible, and shaped as queueing says they should be."""

from __future__ import annotations

import numpy as np

from tests.sim.support import (OUTPUT_TOKENS, PROMPT_TOKENS, SLOT_LIMIT, capacity_rps, chat_class, poisson_requests,
                               run_fifo)
from tidegate.loadgen.arrivals import Poisson
from tidegate.loadgen.mix import LengthDistribution
from tidegate.loadgen.trace import Trace
from tidegate.policy.health import BreakerState
from tidegate.policy.tiers import TierSpec, TierTable
from tidegate.sim.capacity import patient_tiers
from tidegate.sim.fifo import REFUSED_QUEUE_FULL, REFUSED_QUEUE_WAIT, REFUSED_UNKNOWN_TIER, FifoDispatcher
from tidegate.sim.harness import (ClosedLoopClients, Harness, KillReplica, RunResult, TrafficClass, make_requests,
                                  requests_from_trace)
from tidegate.sim.replica import FAILURE_KILLED, ReplicaSpec
from tidegate.sim.report import summarize
from tidegate.sim.seam import SimRequest

KILL_S = 10.0


def _unloaded_ttft_s() -> float:
    result, _ = run_fifo([SimRequest(0, 0.0, "t", "standard", PROMPT_TOKENS, OUTPUT_TOKENS)])
    return result.records[0].ttft_s


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_the_same_seed_gives_identical_records() -> None:
    first, _ = run_fifo(poisson_requests(8.0, 10.0, seed=3), ("r0", "r1"))
    again, _ = run_fifo(poisson_requests(8.0, 10.0, seed=3), ("r0", "r1"))
    other, _ = run_fifo(poisson_requests(8.0, 10.0, seed=4), ("r0", "r1"))
    assert first == again and first.records != other.records


def test_at_half_capacity_ttft_stays_near_the_unloaded_one() -> None:
    requests = poisson_requests(0.5 * capacity_rps(), 30.0)
    summary = summarize(run_fifo(requests)[0], patient_tiers())
    tier = summary.tier("standard")
    assert tier.served == tier.arrived and tier.ttft_p50_s < 1.3 * _unloaded_ttft_s()


def test_at_twice_capacity_ttft_grows_with_time_and_the_replica_stays_busy() -> None:
    result, _ = run_fifo(poisson_requests(2.0 * capacity_rps(), 30.0))
    ttfts_s = [r.ttft_s for r in result.records]
    third = len(ttfts_s) // 3
    early, middle, late = (_mean(ttfts_s[i * third:(i + 1) * third]) for i in range(3))
    assert early < middle < late and late > 3 * early
    assert summarize(result, patient_tiers()).mean_busy_fraction >= 0.8


def test_a_request_waiting_past_its_tier_max_wait_is_refused_then() -> None:
    tiers = TierTable((TierSpec("standard", 0, queue_bound=100, max_queue_wait_s=1.0, ttft_target_s=2.0),),
                      default_tier="standard")
    backlog = [SimRequest(i, 0.0, "t", "standard", 64, 200) for i in range(10)]
    result, _ = run_fifo(backlog, tiers=tiers, slot_limit=2)
    refused = [r for r in result.records if r.refused_reason is not None]
    assert [r.request_id for r in refused] == list(range(2, 10))
    assert {(r.refused_reason, r.refused_s) for r in refused} == {(REFUSED_QUEUE_WAIT, 1.0)}


def test_arrivals_beyond_the_queue_bound_or_of_an_unknown_tier_are_refused_at_once() -> None:
    tiers = TierTable((TierSpec("standard", 0, queue_bound=2, max_queue_wait_s=60.0, ttft_target_s=2.0),),
                      default_tier="standard")
    requests = [SimRequest(i, 0.0, "t", "standard", 16, 8) for i in range(3)] + [
        SimRequest(3, 0.0, "t", "gold", 16, 8)]
    result, _ = run_fifo(requests, tiers=tiers)
    assert [(r.refused_reason, r.refused_s) for r in result.records] == [
        (None, None), (None, None), (REFUSED_QUEUE_FULL, 0.0), (REFUSED_UNKNOWN_TIER, 0.0)]


def test_a_killed_replica_fails_its_requests_and_its_breaker_sends_later_ones_elsewhere() -> None:
    requests = poisson_requests(2.0 * capacity_rps(), 20.0, seed=11)
    result, _ = run_fifo(requests, ("r0", "r1", "r2"), events=[KillReplica(KILL_S, "r0")])
    on_r0 = [r for r in result.records if r.replica_id == "r0"]
    in_flight = [r for r in on_r0 if r.dispatch_s < KILL_S and (r.finish_s is None or r.finish_s > KILL_S)]
    assert len(in_flight) >= 3
    assert all((r.failure_reason, r.failed_s) == (FAILURE_KILLED, KILL_S) for r in in_flight)
    # the breaker's first cool-down: nothing goes to r0; afterwards one probe each cool-down at most
    cooldown_s = 5.0
    assert not [r for r in on_r0 if KILL_S <= r.dispatch_s < KILL_S + cooldown_s]
    assert len([r for r in on_r0 if r.dispatch_s >= KILL_S]) <= 2
    served_after = [r for r in result.records if r.dispatch_s is not None and r.dispatch_s > KILL_S and r.served]
    assert served_after and {r.replica_id for r in served_after} == {"r1", "r2"}


def test_a_killed_replica_breaker_is_open_right_after_the_kill() -> None:
    requests = poisson_requests(2.0 * capacity_rps(), 20.0, seed=11)
    _, dispatcher = run_fifo(requests, ("r0", "r1", "r2"), events=[KillReplica(KILL_S, "r0")], until_s=KILL_S + 0.1)
    assert dispatcher.breaker("r0").state is BreakerState.OPEN
    assert dispatcher.breaker("r1").state is BreakerState.CLOSED and dispatcher.outstanding("r0") == 0


def test_a_trace_replays_one_request_per_row_at_its_offset() -> None:
    trace = Trace(np.array([0.0, 0.5, 1.25]), np.array([100, 0, 40]), np.array([5, 3, 0]))
    requests = requests_from_trace(trace, tenant="azure", tier="standard")
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in requests] == [
        (0.0, 100, 5), (0.5, 1, 3), (1.25, 40, 1)]  # a zero count still costs a token
    result, _ = run_fifo(requests)
    assert [r.arrival_s for r in result.records] == [0.0, 0.5, 1.25] and all(r.served for r in result.records)


def _storm(shared_prefix_tokens: int) -> RunResult:
    """bench/storm_fidelity.py's storm, small: closed-loop clients sending a 269-token prompt."""
    traffic = TrafficClass("acme", "standard", 1.0, LengthDistribution("const", 269), LengthDistribution("const", 32),
                           shared_prefix_tokens=shared_prefix_tokens)
    harness = Harness([ReplicaSpec("r0")], FifoDispatcher(["r0"], patient_tiers(), slot_limit=SLOT_LIMIT))
    return harness.run((), clients=ClosedLoopClients(SLOT_LIMIT, traffic, 0.0, 20.0, seed=1))


def test_a_class_that_sends_one_prompt_is_computed_once_by_the_prefix_cache() -> None:
    # live, the storm's engines compute 13 of its 269 prompt tokens (16 cached blocks of 16): the
    # simulator, given no shared prefix, computed all of them and completed half what live did
    shared, own = _storm(269), _storm(0)
    done_shared = sum(1 for r in shared.records if r.served and r.finish_s < 20.0)
    done_own = sum(1 for r in own.records if r.served and r.finish_s < 20.0)
    assert done_shared > 1.5 * done_own
    assert shared.replicas[0].generated_tokens > own.replicas[0].generated_tokens


def test_requests_of_a_class_with_a_shared_prefix_carry_it() -> None:
    traffic = TrafficClass("acme", "standard", 1.0, LengthDistribution("const", 100), LengthDistribution("const", 8),
                           shared_prefix_tokens=64)
    requests = make_requests(Poisson(5.0), 2.0, [chat_class(), traffic], seed=3)
    shared = [r for r in requests if r.shared_prefix is not None]
    assert shared and all(r.shared_prefix == 1 and r.shared_prefix_tokens == 64 for r in shared)
    ids = [r.prompt_token_ids() for r in shared]
    assert all(i[:64] == ids[0][:64] and i[64:] != ids[0][64:] for i in ids[1:])
    assert all(r.prompt_token_ids() is None for r in requests if r.shared_prefix is None)
