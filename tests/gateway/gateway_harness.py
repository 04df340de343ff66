"""Helpers for gateway tests: handles on mock upstreams and gateways, pool configs."""

from __future__ import annotations

import sys
from pathlib import Path

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
