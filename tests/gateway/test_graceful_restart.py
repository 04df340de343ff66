"""Shutdown and restart without refusing work: /ready turns 503 first, requests in flight finish,
and a new gateway on the same port (SO_REUSEPORT) takes over while the old one drains."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support import ManagedProcess, free_port, start_process, tidegate_argv  # noqa: E402


def _mock(ttft_ms: int, tokens: int = 8) -> tuple[ManagedProcess, int]:
    port = free_port()
    process = start_process(tidegate_argv("mock-upstream", "--port", str(port), "--tokens", str(tokens),
                                          "--ttft-ms", str(ttft_ms), "--itl-ms", "20"),
                            ready_url=f"http://127.0.0.1:{port}/health", timeout_s=30)
    return process, port


def _gateway(tmp: Path, port: int, mock_port: int, **server: object) -> ManagedProcess:
    config = {"server": {"port": port, "access_log": False, **server},
              "pools": [{"name": "m", "backends": [{"type": "upstream", "url": f"http://127.0.0.1:{mock_port}/v1"}]}]}
    path = tmp / f"gateway-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(config))
    return start_process(tidegate_argv("serve", "--config", str(path)), ready_url=f"http://127.0.0.1:{port}/ready",
                         timeout_s=30)


def _wait_own_readiness(process: ManagedProcess, metrics_port: int, timeout_s: float = 30.0) -> None:
    """Waits until this gateway itself listens and routes: on a shared port (SO_REUSEPORT) /ready may
    be answered by the gateway it replaces, so its own metrics listener (opened after the main one)
    is asked whether its replicas take traffic."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.popen.poll() is None, process.log()[-4000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/status.json", timeout=2) as response:
                pools = json.loads(response.read())["pools"]
            if all(replica["routable"] for pool in pools for replica in pool["replicas"]):
                return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"the new gateway was not ready after {timeout_s}s\n{process.log()[-4000:]}")


def _ready_status(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_sigterm_turns_ready_off_first_and_lets_a_stream_in_flight_finish(tmp_path: Path) -> None:
    mock, mock_port = _mock(ttft_ms=200, tokens=60)  # a stream of ~1.4 s
    port = free_port()
    gateway = _gateway(tmp_path, port, mock_port, shutdown_delay_s=1.0)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
    try:
        chunks: list[str] = []
        stream = client.chat.completions.create(model="m", max_tokens=60, stream=True,
                                                messages=[{"role": "user", "content": "a long answer"}])
        reader = threading.Thread(target=lambda: chunks.extend(c.choices[0].finish_reason or "" for c in stream
                                                              if c.choices))
        reader.start()
        time.sleep(0.3)
        gateway.popen.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert _ready_status(port) == 503  # the load balancer is told at once ...
        # ... while the gateway still serves what reaches it during the delay
        reply = client.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].finish_reason == "length"
        reader.join(timeout=20)
        assert chunks[-1] == "length"  # the stream in flight finished whole
        assert gateway.popen.wait(timeout=20) == 0
    finally:
        gateway.stop()
        mock.stop()


def test_a_restart_on_the_same_port_refuses_nothing(tmp_path: Path) -> None:
    mock, mock_port = _mock(ttft_ms=50)
    port = free_port()
    old = _gateway(tmp_path, port, mock_port, reuse_port=True, shutdown_delay_s=0.5)
    new: ManagedProcess | None = None
    failures: list[str] = []
    served = [0]
    stop = threading.Event()

    def load() -> None:
        # keep-alive connections, no retries: any refusal or reset caused by the restart is a failure
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
        for _ in range(2000):
            if stop.is_set():
                return
            try:
                client.chat.completions.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "x"}])
                served[0] += 1
            except openai.APIError as error:
                failures.append(repr(error))

    threads = [threading.Thread(target=load) for _ in range(4)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        new_metrics_port = free_port()
        new = _gateway(tmp_path, port, mock_port, reuse_port=True, shutdown_delay_s=0.5,
                       metrics_port=new_metrics_port)
        _wait_own_readiness(new, new_metrics_port)  # its /ready on the shared port may be the old one's
        before = served[0]
        old.popen.send_signal(signal.SIGTERM)
        assert old.popen.wait(timeout=30) == 0
        time.sleep(1.0)
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
        assert served[0] > before + 10  # the new gateway took the load
        assert failures == []
    finally:
        stop.set()
        old.stop()
        if new is not None:
            new.stop()
        mock.stop()
