"""Starts `tidegate mock-upstream` pinned to one core, for the load-generator benchmarks."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

__all__ = ["start_pinned_mock"]


def start_pinned_mock(core: int, port: int, *args: str) -> subprocess.Popen:
    argv = ["taskset", "-c", str(core), sys.executable, "-m", "tidegate", "mock-upstream", "--port", str(port), *args]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).close()
            return process
        except OSError:
            time.sleep(0.1)
    process.terminate()
    raise RuntimeError("mock upstream did not start")
