"""The exact response cache's pure half: what is cached, its keys, entries and the byte-bounded LRU."""

from __future__ import annotations

import pytest

from tidegate.cache.response import (CachedAnswer, CacheMode, MemoryTier, cache_mode, is_deterministic, request_keys,
                                     semantic_question)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 8}


def test_deterministic_requests_are_greedy_seeded_or_embeddings() -> None:
    assert is_deterministic(CHAT)
    assert is_deterministic({**CHAT, "temperature": 0.7, "seed": 3})
    assert not is_deterministic({**CHAT, "temperature": 0.7})
    assert not is_deterministic({"model": "m", "messages": []})  # OpenAI's default temperature is 1
    assert is_deterministic({"model": "e", "input": ["a", "b"]})


def test_cache_mode_follows_the_client_the_tenant_and_the_pool() -> None:
    sampled = {**CHAT, "temperature": 1}
    assert cache_mode(CHAT, None, cache_sampled=False, tenant_allows=True) is CacheMode.USE
    assert cache_mode(CHAT, b"No-Cache", cache_sampled=False, tenant_allows=True) is CacheMode.REFRESH
    assert cache_mode(CHAT, b"no-store", cache_sampled=False, tenant_allows=True) is CacheMode.BYPASS
    assert cache_mode(CHAT, None, cache_sampled=False, tenant_allows=False) is CacheMode.BYPASS
    assert cache_mode(sampled, None, cache_sampled=False, tenant_allows=True) is CacheMode.BYPASS
    assert cache_mode(sampled, None, cache_sampled=True, tenant_allows=True) is CacheMode.USE


def test_keys_are_scoped_and_cover_every_parameter_but_bookkeeping() -> None:
    keys = request_keys("tenant:a", "CHAT", CHAT)
    assert request_keys("tenant:b", "CHAT", CHAT).exact != keys.exact  # no answer crosses tenants
    assert request_keys("tenant:a", "COMPLETIONS", CHAT).exact != keys.exact
    for changed in ({"max_tokens": 9}, {"stream": True}, {"top_p": 0.5}, {"stop": ["x"]}, {"tools": []}):
        assert request_keys("tenant:a", "CHAT", {**CHAT, **changed}).exact != keys.exact, changed
    for bookkeeping in ({"user": "u1"}, {"metadata": {"k": "v"}}, {"priority": 3}):
        assert request_keys("tenant:a", "CHAT", {**CHAT, **bookkeeping}).exact == keys.exact, bookkeeping
    reordered = dict(reversed(list(CHAT.items())))
    assert request_keys("tenant:a", "CHAT", reordered) == keys  # canonical: key order does not matter


def test_the_loose_key_ignores_sampling_only() -> None:
    keys = request_keys("tenant:a", "CHAT", CHAT)
    assert request_keys("tenant:a", "CHAT", {**CHAT, "temperature": 0.9, "max_tokens": 100}).loose == keys.loose
    assert request_keys("tenant:a", "CHAT", {**CHAT, "stream": True}).loose != keys.loose
    other = {**CHAT, "messages": [{"role": "user", "content": "hello"}]}
    assert request_keys("tenant:a", "CHAT", other).loose != keys.loose


def test_an_entry_survives_its_encoding_and_refuses_garbage() -> None:
    entry = CachedAnswer(b"text/event-stream", True, (b"data: {\"a\": 1}\n\n", b"", b"data: [DONE]\n\n"))
    assert CachedAnswer.decode(entry.encode()) == entry
    for garbage in (b"", b"not json\nrest", b'{"v": 2, "ct": "x", "s": false, "n": [1]}\nx', b'{"v": 1}\n'):
        with pytest.raises(ValueError):
            CachedAnswer.decode(garbage)


def test_the_memory_tier_is_bounded_in_bytes_and_evicts_the_least_recently_used() -> None:
    def answer(size: int) -> CachedAnswer:
        return CachedAnswer(b"application/json", False, (b"x" * size,))

    tier = MemoryTier(max_bytes=3 * answer(100).size_bytes)
    keys = [request_keys("t", "CHAT", {**CHAT, "max_tokens": n}) for n in range(4)]
    for key in keys[:3]:
        tier.put(key, answer(100))
    assert tier.touch(keys[0].exact) is not None  # now the most recent
    tier.put(keys[3], answer(100))
    assert tier.peek(keys[1].exact) is None and tier.evictions == 1  # the least recently used went
    assert tier.peek(keys[0].exact) is not None and tier.bytes <= tier.max_bytes
    assert tier.peek_loose(keys[3].loose) is not None
    tier.put(request_keys("t", "CHAT", {**CHAT, "n": 2}), answer(10_000))  # larger than the bound: not kept
    assert len(tier) == 3


def test_a_semantic_question_is_the_last_user_turn_in_a_scope_of_everything_else() -> None:
    body = {"model": "m", "temperature": 0,
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "How tall is K2?"}]}
    question = semantic_question("tenant:a", "CHAT", body)
    assert question is not None and question.text == "How tall is K2?"
    reworded = {**body, "messages": [body["messages"][0], {"role": "user", "content": "K2's height?"}]}
    assert semantic_question("tenant:a", "CHAT", reworded).scope == question.scope
    other_system = {**body, "messages": [{"role": "system", "content": "be long"}, body["messages"][1]]}
    assert semantic_question("tenant:a", "CHAT", other_system).scope != question.scope
    hotter = {**body, "temperature": 0.5}
    assert semantic_question("tenant:a", "CHAT", hotter).scope != question.scope
    assert semantic_question("tenant:a", "CHAT", hotter).loose_scope == question.loose_scope
    assert semantic_question("tenant:b", "CHAT", body).scope != question.scope
    assert semantic_question("tenant:a", "CHAT", {"prompt": "x"}) is None
    assert semantic_question("tenant:a", "CHAT", {"messages": [{"role": "assistant", "content": "x"}]}) is None
