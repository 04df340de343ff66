"""Helpers for gateway tests: handles on mock upstreams and gateways, pool configs."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support import ManagedProcess  # noqa: E402

class Upstream:
    def __init__(self, process: ManagedProcess, port: int) -> None:
        self.process = process
        self.port = port
        self.url = f"http://127.0.0.1:{port}/v1"


class Gateway:
    def __init__(self, process: ManagedProcess, port: int) -> None:
        self.process = process
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.api = f"{self.base}/v1"


def upstream_pool(name: str, *upstreams: Upstream | str, **backend_options: object) -> dict:
    """A pool config over mock upstreams (or raw URLs, e.g. of a dead port)."""
    urls = [u if isinstance(u, str) else u.url for u in upstreams]
    return {"name": name, "backends": [{"type": "upstream", "url": url, **backend_options} for url in urls]}


def wait_for(check: Callable[[], bool], timeout_s: float, every_s: float = 0.2) -> bool:
    """Polls `check` until it holds or `timeout_s` passes; whether it held."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(every_s)
    return False


class StreamingLoad:
    """Clients streaming short chats in threads while the `with` block runs, or for `duration_s`;
    bounded in count. `answered`: content chunks of each answer; `failed`: every error, refusals
    included (a test that expects refusals does not assert on it)."""

    def __init__(self, base_url: str, model: str, clients: int, *, duration_s: float | None = None,
                 max_tokens: int = 8, key: str = "unused", ignore_eos: bool = False) -> None:
        self.base_url, self.model, self.max_tokens, self.key = base_url, model, max_tokens, key
        self.extra_body = {"ignore_eos": True} if ignore_eos else None
        self.until = None if duration_s is None else time.monotonic() + duration_s
        self.stop = threading.Event()
        self.answered: list[int] = []
        self.failed: list[str] = []
        self.threads = [threading.Thread(target=self._run) for _ in range(clients)]

    def __enter__(self) -> StreamingLoad:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)

    def _run(self) -> None:
        client = openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.key, max_retries=0, timeout=120)
        for _ in range(500):
            if self.stop.is_set() or (self.until is not None and time.monotonic() > self.until):
                return
            try:
                chunks = list(client.chat.completions.create(
                    model=self.model, max_tokens=self.max_tokens, stream=True, extra_body=self.extra_body,
                    messages=[{"role": "user", "content": "tell me a story"}]))
                self.answered.append(sum(1 for c in chunks if c.choices and c.choices[0].delta.content))
            except openai.APIError as error:
                self.failed.append(repr(error))
