"""Prefix affinity: block hashes of prompts, the per-replica index, and the controller's routing by it."""

from __future__ import annotations

import pytest

from tidegate.policy.pool import PoolController, PoolReplica, PoolSettings
from tidegate.policy.prefix import BLOCK_CHARS, CHARS_PER_TOKEN, AffinityLoad, CharsPerToken, PrefixIndex, prefix_blocks
from tidegate.policy.tiers import default_tiers
from tidegate.types import PoolRequest, ReplicaLoad

SYSTEM_A = "You are the support assistant of the A company. " * 40  # ~2,000 characters
SYSTEM_B = "You answer questions about the B railway timetable. " * 40


def test_prompts_sharing_a_prefix_share_its_leading_blocks_only() -> None:
    first = prefix_blocks(["system", SYSTEM_A, "user", "where is my parcel?"])
    second = prefix_blocks(["system", SYSTEM_A, "user", "how do I return a phone?"])
    other = prefix_blocks(["system", SYSTEM_B, "user", "where is my parcel?"])
    shared = len("system\x1e" + SYSTEM_A + "\x1euser\x1e") // BLOCK_CHARS
    assert first[:shared] == second[:shared]
    assert first[0] != other[0] and not set(first) & set(other)
    assert len(prefix_blocks(["x" * (BLOCK_CHARS - 1)])) == 0  # a partial block is not cached by engines


def test_a_block_is_named_by_its_whole_prefix() -> None:
    block = "b" * BLOCK_CHARS
    assert prefix_blocks([block + block])[1] != prefix_blocks([block])[0]


def test_the_index_matches_from_the_first_block_and_forgets_tails_first() -> None:
    index = PrefixIndex(capacity_blocks=4)
    index.record((1, 2, 3))
    assert index.matched((1, 2, 3, 4)) == 3
    assert index.matched((9, 2, 3)) == 0  # a different first block: nothing of it is held
    index.record((7, 8))  # 5 blocks for 4 places: the oldest tail, block 3, goes
    assert index.matched((1, 2, 3)) == 2 and index.matched((7, 8)) == 2
    with pytest.raises(ValueError):
        PrefixIndex(0)


def test_a_smaller_index_forgets_the_least_recently_routed_at_once() -> None:
    index = PrefixIndex(capacity_blocks=8)
    index.record((1, 2, 3))
    index.record((4, 5, 6))
    index.resize(4)  # the engine's cache turned out to hold fewer
    assert len(index) == 4 and index.matched((1, 2, 3)) == 1 and index.matched((4, 5, 6)) == 3
    index.resize(16)
    index.record((7, 8, 9))
    assert len(index) == 7  # a larger bound forgets nothing
    with pytest.raises(ValueError):
        index.resize(0)


def test_characters_a_token_are_the_fallback_until_enough_usage_is_reported() -> None:
    ratio = CharsPerToken(memory_tokens=10_000, min_tokens=2048)
    ratio.observe(1000, 1000)  # byte tokens: a character each
    assert ratio.value() == CHARS_PER_TOKEN
    ratio.observe(1000, 1100)
    ratio.observe(0, 50)  # nothing to learn from
    assert ratio.value() == pytest.approx(2000 / 2100, rel=0.01)
    for _ in range(40):  # the model behind the pool changed: a BPE tokenizer, ~4 characters a token
        ratio.observe(4000, 1000)
    assert ratio.value() == pytest.approx(4.0, rel=0.05)


def _request(request_id: int, system: str, question: str, tokens: int = 600, tenant: str = "t") -> PoolRequest:
    return PoolRequest(request_id, 0.0, tenant, "standard", tokens, 16,
                       prefix=prefix_blocks(["system", system, "user", question]))


def _controller(**settings: object) -> PoolController:
    return PoolController((PoolReplica("r0", max_requests=64), PoolReplica("r1", max_requests=64)), default_tiers(),
                          PoolSettings(**settings))  # type: ignore[arg-type]


def _send(ctl: PoolController, item: PoolRequest, now_s: float) -> str:
    decision = ctl.on_arrival(now_s, item)
    assert decision.assignment is not None
    return decision.assignment.replica_id


def test_requests_sharing_a_prefix_go_where_it_is_cached() -> None:
    ctl = _controller()
    homes: dict[str, list[str]] = {"a": [], "b": []}
    for round_ in range(6):
        for name, system in (("a", SYSTEM_A), ("b", SYSTEM_B)):
            request_id = round_ * 2 + (name == "b")
            now_s = float(request_id)
            homes[name].append(_send(ctl, _request(request_id, system, f"question {round_}"), now_s))
            ctl.on_first_token(now_s + 0.1, request_id)
            ctl.on_finish(now_s + 0.2, request_id)
    assert len(set(homes["a"])) == 1 and len(set(homes["b"])) == 1
    assert homes["a"][0] != homes["b"][0]  # the two prefixes are spread, not piled on one replica


def test_without_affinity_the_same_requests_alternate() -> None:
    ctl = _controller(prefix_cache_tokens=0)
    homes = []
    for request_id in range(6):
        homes.append(_send(ctl, _request(request_id, SYSTEM_A, f"question {request_id}"), float(request_id)))
        ctl.on_first_token(request_id + 0.1, request_id)
        ctl.on_finish(request_id + 0.2, request_id)
    assert len(set(homes)) == 2


def test_the_index_is_bounded_by_the_kv_capacity_its_engine_reports() -> None:
    ctl = _controller()
    # nothing reported: the settings' 32,768 tokens at 4 characters a token, in blocks of 64 characters
    assert ctl.prefix_index_blocks("r0") == ctl.prefix_index_blocks("r1") == 32768 * 4 // BLOCK_CHARS
    ctl.on_capacity(0.0, {"r0": ReplicaLoad(kv_cache_tokens=5120), "r1": ReplicaLoad()})
    assert ctl.prefix_index_blocks("r0") == 5120 * 4 // BLOCK_CHARS
    assert ctl.prefix_index_blocks("r1") == 32768 * 4 // BLOCK_CHARS
    ctl.on_capacity(1.0, {"r0": ReplicaLoad(kv_cache_tokens=2048)})  # restarted with a smaller cache
    assert ctl.prefix_index_blocks("r0") == 2048 * 4 // BLOCK_CHARS


def test_a_configured_kv_capacity_wins_over_the_reported_one() -> None:
    ctl = PoolController((PoolReplica("r0", kv_cache_tokens=1024), PoolReplica("r1")), default_tiers())
    ctl.on_capacity(0.0, {"r0": ReplicaLoad(kv_cache_tokens=5120), "r1": ReplicaLoad(kv_cache_tokens=5120)})
    assert ctl.prefix_index_blocks("r0") == 1024 * 4 // BLOCK_CHARS
    assert ctl.prefix_index_blocks("r1") == 5120 * 4 // BLOCK_CHARS
    assert _controller(prefix_cache_tokens=0).prefix_index_blocks("r0") == 0  # no affinity: no index
    with pytest.raises(ValueError):
        PoolReplica("r0", kv_cache_tokens=0)


def test_the_index_counts_the_engines_tokens_in_the_characters_their_usage_reports() -> None:
    ctl = _controller()
    ctl.on_capacity(0.0, {"r0": ReplicaLoad(kv_cache_tokens=5120), "r1": ReplicaLoad(kv_cache_tokens=5120)})
    for _ in range(3):  # a byte-level tokenizer's prompts: about a token a character
        ctl.on_prompt_usage(1056, 1064)
    blocks = 5120 * 1056 / 1064 / BLOCK_CHARS  # 79.4: a quarter of what 4 characters a token made of it
    assert ctl.prefix_index_blocks("r0") == ctl.prefix_index_blocks("r1") == int(blocks)


def _measure_both(ctl: PoolController) -> None:
    """Both replicas' TTFT lines learnt from exact samples: 50 ms + 1 ms a prompt token."""
    request_id = 1000
    for round_, tokens in enumerate((100, 400, 900, 200, 700, 300)):
        now_s = 10.0 * round_
        pair = (request_id, request_id + 1)
        homes = {_send(ctl, PoolRequest(rid, now_s, "t", "standard", tokens, 16), now_s) for rid in pair}
        assert homes == {"r0", "r1"}
        for rid in pair:
            ctl.on_first_token(now_s + 0.05 + 0.001 * tokens, rid)
            ctl.on_finish(now_s + 1.0, rid)
        request_id += 2


def test_a_hot_prefix_spreads_once_its_replica_is_busier_than_the_prefill_it_saves() -> None:
    ctl = _controller()
    _measure_both(ctl)
    first = _send(ctl, _request(0, SYSTEM_A, "warm up"), 100.0)
    ctl.on_first_token(100.7, 0)  # its prefill is done: the replica holds the prefix now
    homes = [_send(ctl, _request(i, SYSTEM_A, f"burst {i}"), 101.0) for i in range(1, 41)]
    leading = 0
    while homes[leading] == first:
        leading += 1
    assert leading >= 1  # the cached replica first
    # then the other takes a whole prompt, caches it too, and the two share the burst
    held = {replica: homes.count(replica) + (replica == first) for replica in ("r0", "r1")}
    assert max(held.values()) <= 1.5 * min(held.values()) + 1


def test_a_replica_with_few_requests_keeps_the_prefixes_it_holds() -> None:
    """Three requests of a prefix decode where it is cached and the other replica is idle: the
    fourth still goes where its prefix is (the cap spares a replica under a quarter of its slots);
    a whole prompt elsewhere would cost more than three decodes."""
    ctl = _controller()
    _measure_both(ctl)
    home = _send(ctl, _request(0, SYSTEM_A, "warm up"), 100.0)
    ctl.on_first_token(100.7, 0)
    ctl.on_finish(101.0, 0)
    for i in range(1, 5):
        assert _send(ctl, _request(i, SYSTEM_A, f"question {i}"), 101.0 + i) == home
        ctl.on_first_token(101.05 + i, i)  # decoding from here on, held until the end


def test_decodes_do_not_pile_onto_the_replica_that_looks_fastest() -> None:
    """r0's first tokens came fast (its prompts were cached), r1's slowly: r0 predicts the shorter
    time to first token whenever its prefill queue is empty, and nothing in the prediction counts
    the decodes it already runs."""
    ctl = _controller(prefix_cache_tokens=0)
    request_id = 2000
    for round_, tokens in enumerate((100, 400, 900, 200, 700, 300)):
        now_s = 10.0 * round_
        for replica_ttft_s in (0.02, 0.5):  # r0 then r1 (the pair goes to both replicas)
            homes = _send(ctl, PoolRequest(request_id, now_s, "t", "standard", tokens, 16), now_s)
            ctl.on_first_token(now_s + replica_ttft_s + 0.0001 * tokens * (homes == "r1"), request_id)
            ctl.on_finish(now_s + 1.0, request_id)
            request_id += 1
    held = {"r0": 0, "r1": 0}
    for i in range(30):  # each answered at once, then decoding: held, with no prefill ahead
        now_s = 100.0 + i
        prompt = _request(i, f"Conversation {i}. " + SYSTEM_B, "go on", tokens=300)  # prefixes shared by none
        home = _send(ctl, prompt._replace(arrival_s=now_s), now_s)
        ctl.on_first_token(now_s + 0.01, i)
        held[home] += 1
    assert max(held.values()) <= 1.5 * min(held.values()) + 1, held


def test_affinity_load_decays_with_its_half_life_and_moves_a_prefix_whole() -> None:
    load = AffinityLoad(half_life_s=10.0)
    for _ in range(8):
        load.record(0.0, "r0", key=7)
    load.record(0.0, "r1", key=None)
    assert load.replica_load(0.0, "r0") == 8 and load.prefix_load(0.0, 7) == 8
    assert load.replica_load(10.0, "r0") == pytest.approx(4.0)  # a half-life later, half
    load.move(10.0, 7, "r0", "r1")
    assert load.replica_load(10.0, "r0") == pytest.approx(0.0)
    assert load.replica_load(10.0, "r1") == pytest.approx(4.5)
    with pytest.raises(ValueError):
        AffinityLoad(half_life_s=0.0)


def test_a_prefix_moves_only_when_it_evens_loads_out_by_more_than_noise() -> None:
    load = AffinityLoad(half_life_s=1e9)  # no decay within the test
    for _ in range(40):
        load.record(0.0, "busy", key=1)  # the big prefix: moving it only flips the imbalance
    for _ in range(20):
        load.record(0.0, "busy", key=2)  # a middling one
    for _ in range(2):
        load.record(0.0, "busy", key=3)  # a tiny one: moving it narrows the gap by less than noise
    for _ in range(20):
        load.record(0.0, "idle", key=4)
    # 62 against 20: the difference, 42, is over twice its noise (sqrt(82) ~ 9)
    assert load.move_target(0.0, 1, "busy", ["idle"]) is None  # min(40, 2) = 2
    assert load.move_target(0.0, 3, "busy", ["idle"]) is None  # min(2, 40) = 2
    assert load.move_target(0.0, 2, "busy", ["idle"]) == "idle"  # min(20, 22) = 20 > 9
    load.move(0.0, 2, "busy", "idle")
    assert load.move_target(0.0, 2, "idle", ["busy"]) is None  # 42 against 40: no way back
    assert load.move_target(0.0, 2, "idle", []) is None


def test_affinity_load_asked_hours_after_its_last_request_reads_nothing() -> None:
    load = AffinityLoad(half_life_s=30.0)
    load.record(0.0, "r0", key=5)
    later_s = 10 * 3600.0  # 1,200 half-lives: 2 ** 1200 is past a float
    assert load.replica_load(later_s, "r0") == pytest.approx(0.0)
    assert load.move_target(later_s, 5, "r0", ["r1"]) is None
    load.record(later_s, "r0", key=5)
    assert load.replica_load(later_s, "r0") == pytest.approx(1.0)


def test_affinity_load_keeps_its_loads_across_a_rebase() -> None:
    load = AffinityLoad(half_life_s=1.0)
    load.record(0.0, "r0", key=5)
    load.record(100.0, "r0", key=5)  # past 64 half-lives: the grown loads are rebased first
    assert load.replica_load(101.0, "r0") == pytest.approx(0.5)
    assert load.prefix_load(100.0, 5) == pytest.approx(1.0)


def test_a_busier_replica_hands_a_prefix_whole_to_a_quieter_one() -> None:
    """Two prefixes whose first requests went to one replica, each answered before the next: that
    replica serves every request (each is cached there) while the other idles, until one prefix
    moves, whole, and each replica serves one."""
    ctl = _controller()
    _measure_both(ctl)
    homes: dict[str, list[str]] = {"a": [], "b": []}
    moved_from: list[str | None] = []
    request_id, now_s = 0, 100.0
    for round_ in range(30):
        for name, system in (("a", SYSTEM_A), ("b", SYSTEM_B)):
            decision = ctl.on_arrival(now_s, _request(request_id, system, f"q {round_}"))
            assert decision.assignment is not None
            homes[name].append(decision.assignment.replica_id)
            moved_from.append(decision.assignment.prefix_moved_from)
            ctl.on_first_token(now_s + 0.05, request_id)
            ctl.on_finish(now_s + 0.1, request_id)
            request_id, now_s = request_id + 1, now_s + 0.2
    assert homes["a"][0] == homes["b"][0]  # both started where the fitted line is fastest
    # the move is reported with the assignment that made it (the body counts it), once
    assert [source for source in moved_from if source is not None] == [homes["a"][0]]
    moved = [name for name in "ab" if len(set(homes[name])) > 1]
    assert len(moved) == 1, homes  # one prefix moved, once, whole
    after = homes[moved[0]].index(next(r for r in homes[moved[0]] if r != homes[moved[0]][0]))
    assert len(set(homes[moved[0]][after:])) == 1 and after < 10, homes
    assert {homes["a"][-1], homes["b"][-1]} == {"r0", "r1"}
