"""The live body's part in prefix-aware routing (rule 7 of `policy.pool`): each replica's prefix index
sized from the KV capacity its engine reports, in the characters a token its usage says, and the
prefixes moved between replicas counted in /metrics. No network: the pool controller over real
ModelPools, on a fake clock."""

from __future__ import annotations

from tests.gateway.test_overload_runtime import FakeClock, _metric, _runtime
from tidegate.gateway.overload import OverloadRuntime, Ticket
from tidegate.policy.identity import Identity
from tidegate.policy.prefix import BLOCK_CHARS
from tidegate.types import ReplicaHealth, ReplicaLoad

_WHO = Identity("t", None)
SYSTEM_A = "You are the support assistant of the A company. " * 40  # ~2,000 characters
SYSTEM_B = "You answer questions about the B railway timetable. " * 40


def _chat(system: str, question: str) -> dict:
    return {"model": "m", "max_tokens": 16,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def _done(runtime: OverloadRuntime, ticket: Ticket, prompt_tokens: int | None = None) -> None:
    runtime.ended(ticket, None)
    runtime.settle(ticket, 3, prompt_tokens)


def test_each_index_is_sized_by_the_kv_capacity_its_engine_reported() -> None:
    runtime, pool = _runtime(replicas=2, slot_limit=8)
    controller = runtime.bodies["m"].controller
    default_blocks = controller.prefix_index_blocks("r0")
    # the health checks read the engines' pages: r0's says 5,120 tokens, r1's nothing
    pool.replicas[0].load = ReplicaLoad(kv_cache_tokens=5120)
    for replica in pool.replicas:
        replica.health = ReplicaHealth.HEALTHY
    runtime.bodies["m"].wake(runtime.clock())  # what a health change does: fresh loads to the controller
    assert controller.prefix_index_blocks("r0") == 5120 * 4 // BLOCK_CHARS
    assert controller.prefix_index_blocks("r1") == default_blocks == 32768 * 4 // BLOCK_CHARS
    # and /metrics shows what the gateway counts each replica as holding, in characters
    assert _metric(runtime, "tidegate_replica_prefix_index_characters", pool="m", replica="r0") == 5120 * 4


def test_a_configured_kv_capacity_wins_and_zero_turns_affinity_off() -> None:
    runtime, pool = _runtime({"limits": {"prefix_cache_tokens": 1024}}, replicas=1)
    pool.replicas[0].load = ReplicaLoad(kv_cache_tokens=5120)
    runtime.bodies["m"].wake(runtime.clock())
    assert runtime.bodies["m"].controller.prefix_index_blocks("r0") == 1024 * 4 // BLOCK_CHARS
    off, _ = _runtime({"limits": {"prefix_cache_tokens": 0}})
    assert off.bodies["m"].controller.prefix_index_blocks("r0") == 0


async def test_the_engines_usage_turns_their_tokens_into_the_indexs_characters() -> None:
    runtime, pool = _runtime(replicas=1, slot_limit=8)
    pool.replicas[0].load = ReplicaLoad(kv_cache_tokens=5120)
    runtime.bodies["m"].wake(runtime.clock())
    body = _chat(SYSTEM_A, "where is my parcel?")
    chars = len("system\x1e" + SYSTEM_A + "\x1euser\x1ewhere is my parcel?")
    for request_id in range(3):  # a byte-level tokenizer: a token a character, and a few for the template
        ticket = runtime.admit(runtime.clock(), f"q{request_id}", _WHO, "m", body)
        await runtime.acquire(ticket)
        _done(runtime, ticket, prompt_tokens=chars + 20)
    blocks = runtime.bodies["m"].controller.prefix_index_blocks("r0")
    # the gateway counts a prompt's characters by its blocks, its partial last one half full
    assert abs(blocks - 5120 * chars / (chars + 20) / BLOCK_CHARS) <= 2


async def _measure_both(runtime: OverloadRuntime, clock: FakeClock) -> None:
    """Both replicas' TTFT lines learnt: 50 ms + 1 ms a prompt token, pairs of requests at once."""
    for round_, tokens in enumerate((100, 400, 900, 200, 700, 300)):
        clock.now_s = 10.0 * round_
        prompts = [_chat(f"measure {round_} {i} " + "y" * 4 * tokens, "go") for i in range(2)]
        tickets = [runtime.admit(clock(), f"m{round_}-{i}", _WHO, "m", prompt) for i, prompt in enumerate(prompts)]
        assert {(await runtime.acquire(ticket)).replica_id for ticket in tickets} == {"r0", "r1"}
        clock.now_s += 0.05 + 0.001 * tokens
        for ticket in tickets:
            runtime.first_token(ticket)
        clock.now_s = 10.0 * round_ + 1.0
        for ticket in tickets:
            _done(runtime, ticket)


async def test_a_prefix_moved_to_a_quieter_replica_is_counted() -> None:
    """Two prefixes whose first requests went to one replica, each answered before the next: one
    moves, whole, once the other replica's recent load is lower by more than noise."""
    clock = FakeClock()
    runtime, _ = _runtime(replicas=2, slot_limit=64, clock=clock)
    await _measure_both(runtime, clock)
    assert _metric(runtime, "tidegate_prefix_moves_total", pool="m") in (None, 0.0)
    clock.now_s = 100.0
    homes: dict[str, list[str]] = {"a": [], "b": []}
    for round_ in range(30):
        for name, system in (("a", SYSTEM_A), ("b", SYSTEM_B)):
            ticket = runtime.admit(clock(), f"{name}{round_}", _WHO, "m", _chat(system, f"q {round_}"))
            homes[name].append((await runtime.acquire(ticket)).replica_id)
            clock.now_s += 0.05
            runtime.first_token(ticket)
            clock.now_s += 0.05
            _done(runtime, ticket)
            clock.now_s += 0.1
    moved = [name for name in "ab" if len(set(homes[name])) > 1]
    assert len(moved) == 1, homes
    assert _metric(runtime, "tidegate_prefix_moves_total", pool="m") == 1.0

