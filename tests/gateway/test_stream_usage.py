"""A streamed answer's token counts, as overload control settles them: the upstream's usage chunk
when it sends one (wherever it falls in the pieces), else one event a token less `[DONE]`."""

from __future__ import annotations

from tidegate.gateway.proxy import _Usage


def _pieces(*events: bytes) -> list[bytes]:
    return [b"data: " + event + b"\n\n" for event in events]


def test_the_usage_chunk_of_a_stream_gives_its_counts() -> None:
    usage = _Usage(None)  # type: ignore[arg-type]  # the ticket is not read while streaming
    usage.stream_pieces(_pieces(b'{"choices":[{"delta":{"content":"a"}}]}', b'{"choices":[{"delta":{"content":"b"}}]}'))
    usage.stream_pieces(_pieces(b'{"choices":[],"usage":{"prompt_tokens":11,"completion_tokens":7}}', b"[DONE]"))
    assert (usage.completion_tokens(), usage.prompt_tokens, usage.events) == (7, 11, 4)


def test_a_stream_without_usage_counts_one_token_an_event() -> None:
    usage = _Usage(None)  # type: ignore[arg-type]
    usage.stream_pieces(_pieces(b'{"choices":[{"delta":{"content":"a"}}]}', b'{"choices":[{"delta":{"content":"b"}}]}',
                                b"[DONE]"))
    assert (usage.completion_tokens(), usage.prompt_tokens) == (2, None)
