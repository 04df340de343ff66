"""Process faults on child processes this test starts (and stops), and the skips where a fault cannot be done."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest

from tests.support import free_port, start_process, tidegate_argv
from tidegate.chaos import process_faults as pf
from tidegate.chaos.partition import NetnsReplica, unavailable_reason
from tidegate.chaos.process_faults import Member, Outcome

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for child in started:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)


def _spawn(children: list[subprocess.Popen]) -> subprocess.Popen:
    child = subprocess.Popen(SLEEPER)
    children.append(child)
    return child


def _state(pid: int) -> str:
    # /proc/<pid>/stat: "pid (comm) state ...": T when stopped by a signal
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().rsplit(")", 1)[1].split()[0]


def test_kill_sends_sigkill(children) -> None:
    child = _spawn(children)
    result = pf.kill([child.pid])
    assert result.outcome is Outcome.APPLIED and result.pids == (child.pid,)
    assert child.wait(timeout=10) == -9


def test_kill_of_a_process_that_is_gone_fails_with_the_reason(children) -> None:
    child = _spawn(children)
    child.kill()
    child.wait(timeout=10)
    result = pf.kill([child.pid])
    assert result.outcome is Outcome.FAILED and "not running" in result.detail


def test_pause_stops_the_process_until_resumed(children) -> None:
    child = _spawn(children)
    assert pf.pause([child.pid]).outcome is Outcome.APPLIED
    deadline = time.monotonic() + 5
    while _state(child.pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _state(child.pid) == "T"
    assert pf.resume([child.pid]).outcome is Outcome.APPLIED
    deadline = time.monotonic() + 5
    while _state(child.pid) == "T" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _state(child.pid) != "T"
    assert child.poll() is None


def test_restart_runs_the_members_command_and_marks_it_up(children) -> None:
    member = Member(pid=1, restart_command=tuple(SLEEPER), killed=True)
    result = pf.restart(member)
    assert member.started is not None
    children.append(member.started)
    assert result.outcome is Outcome.APPLIED and result.pids == (member.started.pid,)
    assert member.current_pid() == member.started.pid and not member.killed
    assert os.getsid(member.started.pid) == member.started.pid  # its own session: it outlives the run


def test_restart_without_a_command_is_skipped() -> None:
    assert pf.restart(Member(pid=1)).outcome is Outcome.SKIPPED


def test_choose_fraction_rounds_and_takes_at_least_one() -> None:
    rng = random.Random(0)
    assert len(pf.choose_fraction(range(5), 0.2, rng)) == 1
    assert len(pf.choose_fraction(range(3), 0.2, rng)) == 1
    assert len(pf.choose_fraction(range(4), 0.5, rng)) == 2
    assert sorted(pf.choose_fraction(range(4), 1.0, rng)) == [0, 1, 2, 3]
    assert pf.choose_fraction([], 0.5, rng) == []


def test_a_member_is_found_by_the_port_it_listens_on() -> None:
    port = free_port()
    mock = start_process(tidegate_argv("mock-upstream", "--port", str(port)),
                         ready_url=f"http://127.0.0.1:{port}/health", timeout_s=30)
    try:
        assert pf.pid_listening_on(port) == mock.pid
        assert Member(port=port).current_pid() == mock.pid
        assert pf.listens_on(mock.pid, port)
        assert not pf.listens_on(os.getpid(), port)  # another process: not the listener
    finally:
        mock.stop()
    assert pf.pid_listening_on(port) is None
    assert not pf.listens_on(mock.pid, port)


async def test_cpu_pressure_burns_cpu_near_the_target_for_its_duration(children) -> None:
    child = _spawn(children)
    # the same interpreter asleep for as long, beside it: what starting up alone costs on this machine
    idle = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import time; time.sleep(1.0); print(time.process_time())", stdout=subprocess.PIPE)
    started = time.monotonic()
    result, (idle_out, _) = await asyncio.gather(pf.cpu_pressure(1, 1.0, near_pid=child.pid), idle.communicate())
    assert result.outcome is Outcome.APPLIED
    assert f"of pid {child.pid}" in result.detail
    assert time.monotonic() - started >= 1.0
    assert result.measured["cpu_s"] > 2 * float(idle_out)


async def test_memory_pressure_holds_the_memory_resident() -> None:
    result = await pf.memory_pressure(64, 0.2)
    assert result.outcome is Outcome.APPLIED
    assert result.measured["rss_mb"] >= 64


async def test_cancelled_pressure_stops_its_workers() -> None:
    task = asyncio.ensure_future(pf.cpu_pressure(1, 30.0))
    await asyncio.sleep(0.5)
    workers = [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and _parent(int(pid)) == os.getpid()
               and "monotonic() + float" in _cmdline(int(pid))]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.2)
    assert workers and all(not os.path.exists(f"/proc/{pid}") or _state(pid) == "Z" for pid in workers)


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_kubernetes_pod_deletion_is_skipped_without_a_cluster(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    result = pf.delete_pods("default", "app=vllm", 0.2, random.Random(0))
    assert result.outcome is Outcome.SKIPPED
    assert "Kubernetes" in result.detail


def test_partition_drops_traffic_until_healed() -> None:
    reason = unavailable_reason()
    if reason is not None:
        assert "root" in reason or "ip" in reason  # the message says what is missing
        pytest.skip(reason)
    port = free_port()
    # a subnet of its own per test run, so concurrent runs on this machine do not collide
    subnet = ipaddress.ip_network(f"10.213.{os.getpid() % 250}.{4 * (port % 60)}/30")
    replica = NetnsReplica(f"test-{os.getpid()}-{port}", tuple(tidegate_argv("mock-upstream", "--host", "0.0.0.0",
                                                                             "--port", str(port))), str(subnet))
    try:
        assert replica.setup().outcome is Outcome.APPLIED
        url = f"http://{replica.replica_ip}:{port}/health"
        assert _reachable(url, timeout_s=30)
        assert replica.cut().outcome is Outcome.APPLIED
        with pytest.raises(OSError):  # a timeout: packets are dropped, not refused
            urllib.request.urlopen(url, timeout=0.5)
        assert replica.heal().outcome is Outcome.APPLIED
        assert _reachable(url, timeout_s=10)
    finally:
        replica.teardown()
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert replica.namespace not in namespaces


def _reachable(url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                return response.status == 200
        except OSError:
            time.sleep(0.1)
    return False
