"""CPU cost of keeping an upstream key out of answers (tidegate.gateway.scrub), per body and per event.

    python bench/scrub_cost.py          # a few seconds; best of 7 rounds, so other load matters little

Only replicas with an `api_key` pay it. For scale: the gateway spends ~70-100 µs of CPU a request.
"""

from __future__ import annotations

import json
import time

from tidegate.gateway.scrub import SecretScrubber, StreamScrubber, safe_content_type

KEY = "sk-proj-Abc123def456ghiJKL789mnoPQR012stu"
SCRUBBER = SecretScrubber(KEY)


def _per_call_us(call, number: int = 20000, rounds: int = 7) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(number):
            call()
        best = min(best, time.perf_counter() - start)
    return best / number * 1e6


def _completion(content: str, ensure_ascii: bool = False) -> bytes:
    return json.dumps({"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                    "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 12, "completion_tokens": 400, "total_tokens": 412}},
                      ensure_ascii=ensure_ascii).encode()


def main() -> None:
    prose = "The quick brown fox jumps over the lazy dog.\n" * 42  # newlines: JSON backslashes
    body = _completion(prose)
    escaped_body = _completion(prose.replace("fox", "f\u00f6x"), ensure_ascii=True)  # \u escapes throughout
    event = b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":0,"model":"m","choices":' \
            b'[{"index":0,"delta":{"content":" lazy"},"logprobs":null,"finish_reason":null}]}\n\n'
    error = b'{"error":{"message":"The model is overloaded, try again later (request id 4f2a9c).",' \
            b'"type":"server_error","param":null,"code":"overloaded"}}'
    leak = b'{"error":{"message":"Incorrect API key provided: Bearer ' + KEY.replace("-", "\\u002d").encode() \
           + b'","type":"invalid_request_error","code":"invalid_api_key"}}'
    stream = StreamScrubber(SCRUBBER)
    out: list[bytes] = []

    def one_event() -> None:
        stream.pieces.append(event)
        stream.drain(out)
        out.clear()

    rows = [
        (f"200 body, {len(body)} B", lambda: SCRUBBER.scrub_answer(200, body)),
        (f"200 body with \\u escapes, {len(escaped_body)} B", lambda: SCRUBBER.scrub_answer(200, escaped_body)),
        (f"SSE event through the stream scrubber, {len(event)} B", one_event),
        (f"error body (thorough), {len(error)} B", lambda: SCRUBBER.scrub_answer(503, error)),
        (f"error body (thorough), {len(body)} B with \\n", lambda: SCRUBBER.scrub_answer(500, body)),
        (f"error body (thorough), {len(escaped_body)} B with \\u", lambda: SCRUBBER.scrub_answer(500, escaped_body)),
        (f"error body quoting the key (a hit), {len(leak)} B", lambda: SCRUBBER.scrub_answer(401, leak)),
        ("content-type, usual value", lambda: safe_content_type(b"application/json", b"application/json", SCRUBBER)),
        ("content-type, other value", lambda: safe_content_type(b"text/plain; charset=UTF-8", b"", SCRUBBER)),
    ]
    for name, call in rows:
        number = 20000 if "thorough" not in name and "hit" not in name else 2000
        print(f"{name:<52} {_per_call_us(call, number):8.2f} µs")


if __name__ == "__main__":
    main()
