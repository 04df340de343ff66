"""How exact a failed-over stream is on the embedded engine: continuation from the token ids vs from
the text alone.

    python bench/failover_continuation.py [--model tiny-random-llama] [--prompts 6] [--max-tokens 24]

Starts one `tidegate engine` on loopback. For each prompt (chat and completions), streams a greedy
answer (temperature 0, `ignore_eos`, `max_tokens` tokens) with the gateway's `x-tidegate-token-ids`
header, then for each cut k cuts the stream after k token events and continues it as the gateway's
failover does (`gateway/failover.py`: parse what was sent, build the continuation, splice its
events), once with the token ids the engine announced and once from the text alone (what any other
upstream gets). Prints, per way, the share of (prompt, k) whose spliced text equals the uninterrupted
text, and how many of the uninterrupted answers held a U+FFFD (bytes that are not UTF-8, which text
cannot carry back). Bounded: prompts x cuts x 2 requests, each <= max_tokens tokens.
"""

from __future__ import annotations

import argparse
import http.client
import subprocess
import sys
import tempfile
import time
import urllib.request

import orjson

from tidegate.gateway.failover import FailoverPolicy, Splice, continuation_body, parse_sent, refusal
from tidegate.ports import free_port

PROMPTS = ["hi", "Where do the tides turn?", "Ünïcödé ✓ and more", "abc", "The tide gate at the river mouth",
           "List three rivers.", "0123456789", "Why is the sea salty?"]
CUTS = (1, 3, 7, 12, 20)


def stream(port: int, path: str, body: dict, ids: bool) -> bytes:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"content-type": "application/json", **({"x-tidegate-token-ids": "1"} if ids else {})}
    connection.request("POST", path, orjson.dumps(body), headers)
    response = connection.getresponse()
    data = response.read()
    connection.close()
    if response.status != 200:
        raise RuntimeError(data.decode(errors="replace"))
    return data


def text_of(data: bytes, chat: bool) -> str:
    out = []
    for line in data.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in orjson.loads(line[6:])["choices"]:
                out.append((choice["delta"].get("content") or "") if chat else choice["text"])
    return "".join(out)


def cut(data: bytes, k: int, chat: bool) -> bytes:
    sent: list[bytes] = []
    for event in (e + b"\n\n" for e in data.split(b"\n\n") if e.strip()):
        if parse_sent(b"".join(sent), chat).tokens == k:
            break
        sent.append(event)
    return b"".join(sent)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-random-llama")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="tidegate-bench-continuation-", suffix=".log", delete=False)
    engine = subprocess.Popen([sys.executable, "-m", "tidegate", "engine", "--model", args.model, "--port", str(port),
                               "--threads", "1"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or engine.poll() is not None:
                    raise RuntimeError(f"engine did not start; see {log.name}") from None
                time.sleep(0.2)
        exact = {"token ids": 0, "text": 0}
        cases = lossy = 0
        for chat in (True, False):
            path = "/v1/chat/completions" if chat else "/v1/completions"
            for prompt in PROMPTS[:args.prompts]:
                body = {"model": args.model, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True},
                        **({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})}
                whole = stream(port, path, body, ids=True)
                text = text_of(whole, chat)
                lossy += "\ufffd" in text
                for k in CUTS:
                    if k >= args.max_tokens:
                        continue
                    cases += 1
                    for way, ids in (("token ids", True), ("text", False)):
                        state = parse_sent(cut(whole, k, chat), chat)
                        if not ids:
                            state.token_ids = None
                        assert refusal(body, state, FailoverPolicy()) is None
                        continuation = continuation_body(body, state, args.model, send_token_ids=ids)
                        spliced = b"".join(Splice(state, True).feed(stream(port, path, continuation, ids)))
                        exact[way] += text_of(cut(whole, k, chat) + spliced, chat) == text
        print(f"{args.model}, greedy, {args.max_tokens} tokens, cuts {CUTS}: {cases} (prompt, k) cases over chat "
              f"and completions; {lossy} of {2 * args.prompts} uninterrupted answers hold U+FFFD")
        for way, count in exact.items():
            print(f"  continued from the {way}: {count}/{cases} exact ({100 * count / cases:.1f} %)")
    finally:
        engine.terminate()
        engine.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
