"""The pure half of mid-stream failover: what was sent, whether to continue, the continuation, the splice."""

from __future__ import annotations

import orjson

from tidegate.gateway.failover import FailoverPolicy, SentStream, Splice, continuation_body, merge_usage, \
    parse_sent, refusal

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "stream": True}


def _event(content: str | None = None, role: bool = False, finish: str | None = None, id_: str = "c1",
           usage: dict | None = None, choices: bool = True) -> bytes:
    delta = {"role": "assistant", "content": ""} if role else ({"content": content} if content is not None else {})
    event = {"id": id_, "object": "chat.completion.chunk", "created": 7, "model": "m",
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if choices else []}
    if usage is not None:
        event["usage"] = usage
    return b"data: " + orjson.dumps(event) + b"\n\n"


def test_parse_sent_collects_the_text_and_tokens_but_not_the_role_opening() -> None:
    state = parse_sent(_event(role=True) + _event(" a") + _event(" b"), chat=True)
    assert (state.text, state.tokens, state.id, state.created, state.finished) == (" a b", 2, "c1", 7, False)
    assert state.token_ids is None and state.problem is None


def test_token_ids_count_only_for_events_sent_whole() -> None:
    sent = b": token_ids 5\n" + _event(" a") + b": token_ids 6\n"  # the second event never came
    assert parse_sent(sent, chat=True).token_ids == [5]


def test_continuation_asks_for_the_rest_of_the_answer() -> None:
    state = parse_sent(_event(role=True) + _event(" a") + _event(" b"), chat=True)
    assert refusal(CHAT, state, FailoverPolicy()) is None
    body = continuation_body(CHAT, state, "upstream-m")
    assert body["messages"][-1] == {"role": "assistant", "content": " a b"}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert (body["max_tokens"], body["model"], body["stream_options"]) == (8, "upstream-m", {"include_usage": True})


def test_completions_continue_from_the_prompt_and_the_text() -> None:
    event = b'data: {"id":"x","choices":[{"index":0,"text":" b","finish_reason":null}]}\n\n'
    state = parse_sent(event, chat=False)
    body = continuation_body({"model": "m", "prompt": "a", "stream": True}, state)
    assert (body["prompt"], body["max_tokens"]) == ("a b", 15)  # OpenAI's default of 16, less one sent


def test_unsafe_streams_are_not_continued() -> None:
    state = parse_sent(_event(" a"), chat=True)
    assert refusal(CHAT, state, FailoverPolicy(enabled=False)) == "failover is off for this pool"
    assert refusal({**CHAT, "n": 2}, state, FailoverPolicy()) == "n > 1"
    assert refusal({**CHAT, "tools": [{"type": "function"}]}, state, FailoverPolicy()) == "the request sets 'tools'"
    assert refusal({**CHAT, "logprobs": True}, state, FailoverPolicy()) == "the request sets 'logprobs'"
    assert refusal({**CHAT, "max_tokens": 1}, state, FailoverPolicy()).startswith("every token asked for")
    assert refusal(CHAT, parse_sent(_event(" a", finish="stop"), True), FailoverPolicy()) == \
        "the stream had already ended"
    assert refusal(CHAT, parse_sent(_event(" a")[:-5], True), FailoverPolicy()) == "the client holds part of an event"
    state.failovers = 1
    assert refusal(CHAT, state, FailoverPolicy(max_failovers=1)).startswith("already failed over")


def test_usage_is_the_original_requests() -> None:
    merged = merge_usage({"prompt_tokens": 15, "completion_tokens": 6, "total_tokens": 21}, sent_tokens=4)
    assert merged == {"prompt_tokens": 11, "completion_tokens": 10, "total_tokens": 21}


def test_splice_keeps_one_answer() -> None:
    state = parse_sent(_event(role=True) + _event(" a"), chat=True)
    splice = Splice(state, include_usage=True)
    continuation = (_event(role=True, id_="c2", usage=None) + _event(" b", id_="c2") + _event(finish="stop", id_="c2")
                    + _event(id_="c2", choices=False, usage={"prompt_tokens": 6, "completion_tokens": 2,
                                                             "total_tokens": 8}) + b"data: [DONE]\n\n")
    out = b"".join(splice.feed(continuation[:50]) + splice.feed(continuation[50:]))  # split mid-line
    events = [orjson.loads(line[6:]) for line in out.split(b"\n") if line.startswith(b"data: {")]
    assert {e["id"] for e in events} == {"c1"} and len(events) == 3  # no second role opening
    assert events[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert out.endswith(b"data: [DONE]\n\n") and splice.completion_tokens == 3 and state.text == " a b"


def test_splice_drops_the_usage_the_client_did_not_ask_for() -> None:
    splice = Splice(parse_sent(_event(" a"), chat=True), include_usage=False)
    out = b"".join(splice.feed(_event(" b", usage=None) + _event(choices=False, usage={
        "prompt_tokens": 6, "completion_tokens": 1, "total_tokens": 7})))
    assert b"usage" not in out and splice.completion_tokens == 2


def test_sent_stream_stops_keeping_past_its_bound() -> None:
    sent = SentStream()
    sent.add([b"x" * 10])
    assert sent.kept and sent.data() == b"x" * 10
    for _ in range(600):  # measured every 256 pieces
        sent.add([b"y" * 16384])
    assert not sent.kept and sent == []
    sent.add([b"z"])
    assert sent == []
