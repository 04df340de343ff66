"""A free loopback port for a server this process is about to start.

The kernel picks a port that is free now; it is free again once the probe socket closes, so two calls
in a row may return the same port (seen in CI: a gateway's API port and its metrics port came out
equal and the gateway refused its configuration). Every port handed out is remembered, and none is
handed out twice by one process."""

from __future__ import annotations

import socket
import threading

_handed_out: set[int] = set()
_lock = threading.Lock()
_ATTEMPTS = 1000


def free_port() -> int:
    """A loopback TCP port free at this moment and not returned before by this process."""
    with _lock:
        for _ in range(_ATTEMPTS):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise RuntimeError(f"no free loopback port not handed out already after {_ATTEMPTS} tries")
