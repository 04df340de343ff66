"""The prompt's prefix blocks as the gateway reads them from a request body, for prefix-aware routing."""

from __future__ import annotations

from tidegate.gateway.overload import prompt_prefix

SYSTEM = "You are the assistant of a shop that sells bicycles and their parts. " * 20


def _chat(system: str, question: str) -> dict:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def test_chats_with_one_system_prompt_share_its_blocks() -> None:
    first = prompt_prefix(_chat(SYSTEM, "Do you repair brakes?"))
    second = prompt_prefix(_chat(SYSTEM, "What does a new chain cost?"))
    shared = len(SYSTEM) // 64
    assert len(first) >= shared and first[:shared] == second[:shared]
    assert prompt_prefix(_chat("Another shop. " + SYSTEM, "Do you repair brakes?"))[0] != first[0]


def test_content_parts_prompts_and_odd_bodies() -> None:
    parts = {"messages": [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
                          {"role": "user", "content": "hi"}]}
    assert prompt_prefix(parts)[:5] == prompt_prefix(_chat(SYSTEM, "hi"))[:5]
    assert len(prompt_prefix({"prompt": SYSTEM})) == len(SYSTEM) // 64
    assert prompt_prefix({"messages": ["not a message", {"content": None}]}) == ()
    assert prompt_prefix({"input": "an embedding"}) == ()
