"""Helpers for tests that start real processes on loopback ports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from tidegate.ports import free_port

__all__ = ["free_port", "wait_http_ok", "start_process", "start_redis", "ManagedProcess", "tidegate_argv"]


def tidegate_argv(*args: str) -> list[str]:
    """Runs the CLI with this interpreter, so tests need no `tidegate` on PATH."""
    return [sys.executable, "-m", "tidegate", *args]


def wait_http_ok(url: str, timeout_s: float = 60.0, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode} before {url} was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError) as error:
            last_error = error
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout_s}s: {last_error}")


@dataclass
class ManagedProcess:
    popen: subprocess.Popen
    log_path: str
    argv: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as handle:
                return handle.read()
        except OSError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after timeout_s; only this PID (and its own process group)."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=timeout_s)
        return self.popen.returncode

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=10)


def start_process(
    argv: list[str],
    ready_url: str | None = None,
    timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    log_dir: str | None = None,
) -> ManagedProcess:
    """Starts argv with output to a log file; waits until ready_url answers 200."""
    import tempfile

    log_file = tempfile.NamedTemporaryFile(
        prefix="tidegate-test-", suffix=".log", dir=log_dir, delete=False
    )
    full_env = {**os.environ, **(env or {})}
    popen = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=full_env)
    process = ManagedProcess(popen=popen, log_path=log_file.name, argv=argv)
    if ready_url is not None:
        try:
            wait_http_ok(ready_url, timeout_s=timeout_s, process=popen)
        except Exception as error:
            process.stop()
            raise RuntimeError(f"{argv} failed to become ready: {error}\n--- log ---\n{process.log()[-4000:]}")
    return process


def start_redis(port: int | None = None, timeout_s: float = 20.0, append_only: bool = False,
                data_dir: str | None = None) -> tuple[ManagedProcess, str]:
    """A real `redis-server` on a free loopback port: (process, redis:// URL). Skips the test where
    no redis-server is installed (CI installs it)."""
    import shutil

    import pytest
    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    port = port or free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
            "yes" if append_only else "no", "--protected-mode", "no"]
    if data_dir is not None:
        argv += ["--dir", data_dir]
    process = start_process(argv)
    deadline = time.monotonic() + timeout_s
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)
    while True:
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            if process.popen.poll() is not None or time.monotonic() > deadline:
                process.stop()
                raise RuntimeError(f"redis-server did not start\n{process.log()[-2000:]}") from None
            time.sleep(0.05)
    client.close()
    return process, f"redis://127.0.0.1:{port}/0"
