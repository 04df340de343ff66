"""A modelled replica's KV cache shares prompt prefixes as the engine's does (the same scheduler)."""

from __future__ import annotations

import random
from dataclasses import replace

from tidegate.engine.scheduler import SchedulerConfig
from tidegate.sim.loop import EventLoop
from tidegate.sim.replica import ModelledReplica, ReplicaSpec, StepCostModel

SYSTEM_PROMPT = list(range(1000, 1480))  # 30 blocks


class Recorder:
    def __init__(self, loop: EventLoop) -> None:
        self.loop = loop
        self.first_token_s: dict[int, float] = {}
        self.finish_s: dict[int, float] = {}

    def on_first_token(self, now_s: float, replica_id: str, request_id: int) -> None:
        self.first_token_s[request_id] = now_s

    def on_finish(self, now_s: float, replica_id: str, request_id: int) -> None:
        self.finish_s[request_id] = now_s

    def on_failure(self, now_s: float, replica_id: str, request_id: int, reason: str) -> None:
        raise AssertionError(f"request {request_id} failed: {reason}")


def _ttfts_one_after_another(spec: ReplicaSpec, prompts: list[list[int] | None], prompt_tokens: int) -> list[float]:
    """TTFT of each request, each submitted alone once the one before has finished."""
    loop = EventLoop()
    recorder = Recorder(loop)
    replica = ModelledReplica(spec, loop, recorder)
    ttfts = []
    for request_id, prompt in enumerate(prompts):
        start_s = loop.now_s
        replica.submit(request_id, prompt_tokens, 4, prompt_token_ids=prompt)
        loop.run()
        ttfts.append(recorder.first_token_s[request_id] - start_s)
    return ttfts


def test_a_repeated_system_prompt_is_prefilled_once() -> None:
    spec = ReplicaSpec("r0")
    prompts = [SYSTEM_PROMPT + [tenant] * 20 for tenant in range(3)]
    first, second, third = _ttfts_one_after_another(spec, prompts, len(prompts[0]))
    # the later ones compute their 20 own tokens, not the 480 shared ones
    saved_s = len(SYSTEM_PROMPT) * StepCostModel().prefill_s_per_token
    assert second == third
    assert first - second > 0.8 * saved_s


def test_requests_without_token_ids_share_nothing() -> None:
    ttfts = _ttfts_one_after_another(ReplicaSpec("r0"), [None, None, None], 500)
    assert ttfts[0] == ttfts[1] == ttfts[2]


def test_with_prefix_caching_off_a_repeated_prompt_costs_the_same() -> None:
    spec = ReplicaSpec("r0", scheduler=SchedulerConfig(enable_prefix_caching=False))
    prompts = [SYSTEM_PROMPT + [tenant] * 20 for tenant in range(3)]
    ttfts = _ttfts_one_after_another(spec, prompts, len(prompts[0]))
    assert ttfts[0] == ttfts[1] == ttfts[2]


def _workload(seed: int) -> tuple[ReplicaSpec, list[tuple[float, int, list[int], int]]]:
    """A few requests, most sharing a prefix, on a replica of a few blocks more than the longest needs."""
    rng = random.Random(seed)
    cost = rng.choice([None, 50, 100, 200, 400])
    budget = rng.choice([16, 24, 32, 40, 48, 64])
    shared = SYSTEM_PROMPT[: 16 * rng.randrange(2, 10)]
    arrivals, longest = [], 0
    for request_id in range(rng.randrange(2, 6)):
        shares = rng.random() < 0.7
        prompt = (shared if shares else []) + [rng.randrange(5000, 6000) for _ in range(rng.randrange(1, 40))]
        output_tokens = rng.randrange(1, 40)
        arrivals.append((rng.choice([0.0, 0.0, 0.05, 0.1, 0.3]), request_id, prompt, output_tokens))
        longest = max(longest, len(prompt) + output_tokens)
    config = SchedulerConfig(max_batch_tokens=budget, attention_cost_tokens=cost, max_num_seqs=rng.choice([2, 3, 8]))
    blocks = -(-longest // 16) + rng.randrange(0, 8)
    return ReplicaSpec("r0", scheduler=config, kv_cache_tokens=blocks * 16), arrivals


def _records(spec: ReplicaSpec, arrivals: list[tuple[float, int, list[int], int]]) -> tuple[Recorder, ModelledReplica]:
    loop = EventLoop()
    recorder = Recorder(loop)
    replica = ModelledReplica(spec, loop, recorder)
    for at_s, request_id, prompt, output_tokens in arrivals:
        loop.call_at(at_s, replica.submit, request_id, len(prompt), output_tokens, 0, prompt)
    loop.run()
    return recorder, replica


def test_stretches_give_the_records_of_one_step_at_a_time_with_shared_prefixes() -> None:
    """Stretches stay an optimisation with prefix caching, under KV pressure and preemptions.
    In seed 52 a prompt waits for room while a running sequence that starts as it does computes
    blocks which, once cached, let it in part-way through what would otherwise be one stretch."""
    hit_tokens = preemptions = 0
    for seed in range(120):
        spec, arrivals = _workload(seed)
        (fast, _), (slow, replica) = (_records(replace(spec, stretches=s), arrivals) for s in (True, False))
        for request_id in range(len(arrivals)):
            for name in ("first_token_s", "finish_s"):
                x, y = getattr(fast, name)[request_id], getattr(slow, name)[request_id]
                assert abs(x - y) < 1e-9, (seed, request_id, name, x, y)
        hit_tokens += replica.scheduler.blocks.prefix_hit_tokens
        preemptions += replica.preemptions
    assert hit_tokens > 0 and preemptions > 0
