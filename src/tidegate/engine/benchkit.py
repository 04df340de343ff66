"""Shared by the engine benchmarks in bench/: start a `tidegate engine` process, stream from it.

Streams are read with aiohttp and a minimal SSE parser: the client shares the CPU with the engine,
so it must cost as little as possible. One chunk arrives per generated token.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

import orjson

from tidegate.ports import free_port

__all__ = ["StreamResult", "engine_process", "stream_completion", "free_port"]


@dataclass
class StreamResult:
    token_times_s: list[float] = field(default_factory=list)  # arrival time of each chunk
    completion_tokens: int = 0
    start_s: float = 0.0
    prompt_tokens: int = 0  # as the server counted them (0: it reported no usage)

    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times_s, self.token_times_s[1:])]


@contextlib.contextmanager
def engine_process(engine_args: list[str], timeout_s: float = 120.0) -> Iterator[str]:
    """Yields the base URL of a ready engine; stops it (SIGTERM, then SIGKILL) afterwards."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="tidegate-bench-engine-", suffix=".log", delete=False)
    argv = [sys.executable, "-m", "tidegate", "engine", "--port", str(port), *engine_args]
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"engine exited early; log: {log.name}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine not ready after {timeout_s}s; log: {log.name}")
            time.sleep(0.2)
        yield base
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def stream_completion(session, base: str, body: dict) -> StreamResult:  # type: ignore[no-untyped-def]
    """POSTs a streaming /v1/completions request and records when each token's chunk arrives.
    Raises RuntimeError with the server's answer when it is not a 200."""
    result = StreamResult(start_s=time.perf_counter())
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(base + "/v1/completions", data=orjson.dumps(payload),
                            headers={"Content-Type": "application/json"}) as response:
        if response.status != 200:
            raise RuntimeError(f"{base}: HTTP {response.status}: {(await response.text())[:300]}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("choices"):
                result.token_times_s.append(time.perf_counter())
            if chunk.get("usage"):
                result.completion_tokens = chunk["usage"]["completion_tokens"]
                result.prompt_tokens = chunk["usage"]["prompt_tokens"]
    return result
