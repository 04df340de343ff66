"""The modelled replica: the engine's own scheduler, timed by the cost model."""

from __future__ import annotations

import pytest

from tests.sim.support import run_fifo
from tidegate.engine.scheduler import SchedulerConfig
from tidegate.policy.tiers import default_tiers
from tidegate.sim import scenarios
from tidegate.sim.fifo import FifoDispatcher
from tidegate.sim.harness import Harness, KillReplica, SlowReplica
from tidegate.sim.replica import FAILURE_KILLED, FAILURE_TOO_LONG, ReplicaSpec, StepCostModel
from tidegate.sim.seam import SimRequest

LONG_PROMPT_TOKENS = 480


def _probe_ttft_s(long_prompts_ahead: int, cost: StepCostModel = StepCostModel()) -> float:
    """TTFT of a short prompt that arrives with `long_prompts_ahead` long prompts just before it."""
    ahead = [SimRequest(i, 0.0, "t", "standard", LONG_PROMPT_TOKENS, 1) for i in range(long_prompts_ahead)]
    probe = SimRequest(long_prompts_ahead, 0.0, "t", "standard", 16, 4)
    result, _ = run_fifo([*ahead, probe], specs=[ReplicaSpec("r0", cost=cost)], slot_limit=64)
    ttft_s = result.records[-1].ttft_s
    assert ttft_s is not None
    return ttft_s


def test_step_cost_is_linear_in_prefill_decode_and_context() -> None:
    cost = StepCostModel(base_s=0.01, prefill_s_per_token=0.001, decode_s_per_seq=0.002, context_s_per_token=1e-5)
    assert cost.step_s(100, 4, 1000) == pytest.approx(0.01 + 0.1 + 0.008 + 0.01)


def test_ttft_grows_with_the_prefill_tokens_queued_ahead() -> None:
    ttfts_s = [_probe_ttft_s(k) for k in (0, 2, 4)]
    assert ttfts_s == sorted(ttfts_s) and ttfts_s[0] < 0.1
    # the wait is the prompts' prefill, at the modelled cost per token, plus each step's base cost
    prefill_ahead_s = 4 * LONG_PROMPT_TOKENS * StepCostModel().prefill_s_per_token
    assert prefill_ahead_s <= ttfts_s[2] - ttfts_s[0] <= 1.3 * prefill_ahead_s


def test_a_dearer_prefill_in_the_cost_model_delays_the_first_token_in_proportion() -> None:
    cheap = _probe_ttft_s(4) - _probe_ttft_s(0)
    dear_cost = StepCostModel(prefill_s_per_token=2 * StepCostModel().prefill_s_per_token)
    dear = _probe_ttft_s(4, dear_cost) - _probe_ttft_s(0, dear_cost)
    assert 1.7 < dear / cheap < 2.0


def test_a_small_kv_cache_preempts_and_still_finishes_every_request() -> None:
    # 16 blocks of 16 tokens; each request grows to 100 tokens (7 blocks) while 8 may be held
    requests = [SimRequest(i, 0.0, "t", "standard", 40, 60) for i in range(16)]
    tight, _ = run_fifo(requests, specs=[ReplicaSpec("r0", kv_cache_tokens=256)])
    roomy, _ = run_fifo(requests, specs=[ReplicaSpec("r0")])
    assert tight.replicas[0].preemptions > 0 and roomy.replicas[0].preemptions == 0
    assert all(r.served for r in tight.records)
    # every token generated once (a recomputed sequence resumes where it was), but later: recomputing
    # costs prefill, and fewer sequences fit in a step
    assert tight.replicas[0].generated_tokens == roomy.replicas[0].generated_tokens == 16 * 60
    assert tight.end_s > roomy.end_s


def test_a_request_larger_than_the_whole_cache_fails_instead_of_looping() -> None:
    result, _ = run_fifo([SimRequest(0, 0.0, "t", "standard", 300, 10)], specs=[ReplicaSpec("r0", kv_cache_tokens=256)])
    assert result.records[0].failure_reason == FAILURE_TOO_LONG


def test_killed_replica_fails_what_it_holds_at_the_kill() -> None:
    requests = [SimRequest(i, 0.0, "t", "standard", 64, 200) for i in range(4)]
    result, _ = run_fifo(requests, events=[KillReplica(1.0, "r0")])
    assert [(r.failure_reason, r.failed_s) for r in result.records] == [(FAILURE_KILLED, 1.0)] * 4
    assert not result.replicas[0].alive


def test_slow_down_two_halves_a_saturated_replica_throughput() -> None:
    # both replicas kept full by a backlog; the slowed one frees its slots half as often
    backlog = [SimRequest(i, 0.0, "t", "standard", 64, 32) for i in range(400)]
    result, _ = run_fifo(backlog, ("r0", "r1"), events=[SlowReplica(0.0, "r1", 2.0)], until_s=20.0)
    normal, slowed = result.replicas
    assert 0.45 < slowed.generated_tokens / normal.generated_tokens < 0.55
    assert normal.busy_s == slowed.busy_s == 20.0


def test_priority_from_the_dispatcher_reaches_the_engine_scheduler() -> None:
    spec = ReplicaSpec("r0", scheduler=SchedulerConfig(max_num_seqs=1))
    # both reach the engine at once (slot limit 2) but it runs one at a time: the better tier first
    dispatcher = FifoDispatcher(["r0"], default_tiers(), slot_limit=2, forward_priority=True)
    requests = [SimRequest(0, 0.0, "t", "sheddable", 16, 8), SimRequest(1, 0.0, "t", "critical", 16, 8)]
    result = Harness([spec], dispatcher).run(requests)
    sheddable, critical = result.records
    assert critical.first_token_s < sheddable.first_token_s


def test_stretches_of_decode_steps_give_the_records_of_one_step_at_a_time() -> None:
    """Stretches are an optimisation only: with arrivals cutting them, a slow-down and a death
    among them, every record is the one stepping one step at a time gives (to rounding)."""
    from dataclasses import replace as replaced

    from tidegate.policy.pool import PoolController, PoolReplica
    from tidegate.policy.tiers import default_tiers
    from tidegate.sim.harness import Harness, KillReplica, SlowReplica
    from tidegate.sim.scenarios import mixed, replica_spec

    requests = mixed(12.0, 30.0, (("a", "standard", 0.7), ("b", "critical", 0.3)), seed=5)
    events = (SlowReplica(8.0, "r1", 2.0), KillReplica(20.0, "r2"))
    runs = []
    for stretches in (True, False):
        specs = [replaced(replica_spec(f"r{i}"), stretches=stretches) for i in range(3)]
        controller = PoolController([PoolReplica(f"r{i}", 32, 16) for i in range(3)], default_tiers())
        runs.append(Harness(specs, controller).run(requests, events))
    fast, slow = runs
    assert sum(r.steps for r in fast.replicas) == sum(r.steps for r in slow.replicas)
    assert [r.generated_tokens for r in fast.replicas] == [r.generated_tokens for r in slow.replicas]
    for a, b in zip(fast.records, slow.records):
        assert (a.replica_id, a.refused_reason, a.failure_reason) == (b.replica_id, b.refused_reason, b.failure_reason)
        for name in ("dispatch_s", "first_token_s", "finish_s", "failed_s"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None) and (x is None or abs(x - y) < 1e-6), (a.request_id, name, x, y)


def test_stretches_charge_the_decode_attention_by_the_longest_context_as_single_steps_do() -> None:
    """A stretch's steps grow the longest decode context one token a step, as the engine's do."""
    from dataclasses import replace as replaced

    from tidegate.sim.capacity import patient_tiers

    cost = StepCostModel(decode_attention_s_per_position=2e-5)
    requests = [SimRequest(i, 0.05 * i, "t", "standard", 40 + 97 * (i % 5), 30 + 7 * (i % 4)) for i in range(24)]
    runs = []
    for stretches in (True, False):
        spec = ReplicaSpec("r0", cost=cost, stretches=stretches)
        runs.append(Harness([spec], FifoDispatcher(["r0"], patient_tiers(), slot_limit=16)).run(requests))
    fast, slow = runs
    plain = Harness([replaced(ReplicaSpec("r0"), stretches=False)],
                    FifoDispatcher(["r0"], patient_tiers(), slot_limit=16)).run(requests)
    for a, b, c in zip(fast.records, slow.records, plain.records):
        assert a.finish_s is not None and b.finish_s is not None and c.finish_s is not None
        assert abs(a.finish_s - b.finish_s) < 1e-6, a.request_id
        assert a.finish_s > c.finish_s  # the attention's term was charged


def test_a_decode_left_alone_after_the_row_below_it_is_freed_pays_for_its_own_row_only() -> None:
    """The engine's decode attention reads every mirror row up to the highest one in use, and the
    rows in use are kept dense (`engine.mirror_rows`): when the sequence in row 0 finishes, the one in
    row 1 moves down and decodes alone over one row (it paid for two before the rows were kept dense)."""
    cost = StepCostModel(base_s=0.01, prefill_s_per_token=0.0, decode_s_per_seq=0.0, context_s_per_token=0.0,
                         decode_attention_s_per_position=1e-4)
    requests = [SimRequest(0, 0.0, "t", "standard", 20, 3), SimRequest(1, 0.0, "t", "standard", 20, 9)]
    harness = Harness([ReplicaSpec("r0", cost=cost, stretches=False)],
                      FifoDispatcher(["r0"], default_tiers(), slot_limit=8))
    steps: list[tuple[int, int, float]] = []  # decodes, longest decode context, step time
    harness.replicas["r0"].step_observer = lambda _, start_s, step_s, batch: steps.append(
        (batch.num_decodes, max((c.start + 1 for c in batch.chunks[:batch.num_decodes]), default=0), step_s))
    harness.run(requests)
    alone = [(longest, step_s) for decodes, longest, step_s in steps if decodes == 1]
    together = [(longest, step_s) for decodes, longest, step_s in steps if decodes == 2]
    assert alone and together
    assert all(step_s == pytest.approx(0.01 + 1 * longest * 1e-4) for longest, step_s in alone)  # its own row
    assert all(step_s == pytest.approx(0.01 + 2 * longest * 1e-4) for longest, step_s in together)


def test_the_step_observer_sees_every_step_and_their_times_add_up_to_the_busy_time() -> None:
    requests = [SimRequest(i, 0.01 * i, "t", "standard", 200, 20) for i in range(8)]
    harness = Harness([ReplicaSpec("r0", stretches=False)], FifoDispatcher(["r0"], default_tiers(), slot_limit=8))
    seen: list[tuple[float, float, int]] = []
    harness.replicas["r0"].step_observer = lambda _, start_s, step_s, batch: seen.append(
        (start_s, step_s, batch.num_tokens))
    result = harness.run(requests)
    assert len(seen) == result.replicas[0].steps
    assert sum(tokens for _, _, tokens in seen) == 8 * 200 + 8 * 19  # every prompt token, then a token per decode
    starts = [start for start, _, _ in seen]
    assert starts == sorted(starts)
    # steps do not overlap, and the replica is busy exactly while one runs (no idle gap here: arrivals
    # come faster than a step)
    assert all(a + d <= b + 1e-12 for (a, d, _), (b, _, _) in zip(seen, seen[1:]))
    assert sum(d for _, d, _ in seen) == pytest.approx(result.replicas[0].busy_s)


def test_a_critical_prompt_sent_at_once_still_waits_for_the_worse_step_in_flight() -> None:
    """Why `critical_burst` and `noisy_tenant` miss their P99 bars with the gateway queue at zero
    (`bench/protection_anatomy.py`): the controller sends a critical prompt the moment it arrives,
    and the engine takes it first at the next step, but the step in flight, a full sheddable
    prefill chunk, is not interrupted. What the burst adds to its TTFT is the rest of that step."""
    arrival_s = 0.010  # during the sheddable prompt's first step
    sheddable = SimRequest(0, 0.0, "bulk", "sheddable", 2000, 8)
    critical = SimRequest(1, arrival_s, "vip", "critical", 500, 8)

    def critical_record(requests: list[SimRequest]):
        controller = scenarios.controller(["r0"], default_tiers())
        result = Harness([scenarios.replica_spec("r0")], controller).run(requests)
        return next(r for r in result.records if r.tier == "critical")

    alone, beside = critical_record([critical]), critical_record([sheddable, critical])
    assert alone.ttft_s is not None and beside.ttft_s is not None and beside.first_token_s is not None
    assert beside.dispatch_s == beside.arrival_s  # no wait at the gateway
    spec = scenarios.replica_spec("r0")
    step_in_flight_s = spec.cost.step_s(spec.scheduler.max_batch_tokens, 0, spec.scheduler.max_batch_tokens)
    # its own chunk comes first in the next step (priority), so the rest of the step in flight is
    # what it lost, plus the sheddable tokens that fill what its 500 leave of the step's budget
    added_s = beside.ttft_s - alone.ttft_s
    assert step_in_flight_s - arrival_s <= added_s <= step_in_flight_s - arrival_s + 0.005
