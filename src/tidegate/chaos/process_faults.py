"""Faults done to processes and pods: kill, pause, restart, CPU and memory pressure, Kubernetes pod deletion.

Every function says what it did in a `FaultResult` (applied, skipped with the reason, or failed with
the reason) instead of raising, so one fault that cannot be done never ends an experiment. The
pressure functions run for their whole duration and report what they measured (CPU seconds burnt,
resident memory actually held), not what was asked.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Sequence, TypeVar

__all__ = [
    "Outcome", "FaultResult", "Member", "choose_fraction", "pid_listening_on", "listens_on", "kill", "pause", "resume",
    "restart", "cpu_pressure", "memory_pressure", "delete_pods",
]

T = TypeVar("T")


class Outcome(Enum):
    APPLIED = "applied"
    SKIPPED = "skipped"  # not possible here (no root, no cluster configured, nothing to act on)
    FAILED = "failed"


@dataclass(frozen=True)
class FaultResult:
    outcome: Outcome
    detail: str
    pids: tuple[int, ...] = ()
    measured: dict[str, float] = field(default_factory=dict)  # e.g. {"cpu_s": 19.8} or {"rss_mb": 512.3}


@dataclass
class Member:
    """One local replica: found by PID or by the port it listens on, restartable by a command."""

    pid: int | None = None
    port: int | None = None  # looked up when needed, so a restarted replica is found again
    restart_command: tuple[str, ...] = ()
    address: str | None = None  # host:port as the gateway names the replica (`...@host:port`)
    started: subprocess.Popen | None = None  # the process our restart started, reaped by us
    killed: bool = False  # by this run, and not restarted since

    def current_pid(self) -> int | None:
        if self.started is not None and self.started.poll() is None:
            return self.started.pid
        if self.port is not None:
            return pid_listening_on(self.port)
        return self.pid if self.pid is not None and _alive(self.pid) else None

    def label(self) -> str:
        return self.address or (f"port {self.port}" if self.port is not None else f"pid {self.pid}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, but is not ours to signal
        return True
    return True


def choose_fraction(items: Sequence[T], fraction: float, rng: random.Random) -> list[T]:
    """round(fraction x n) of the items, at least one when fraction > 0 (20 % of 3 replicas is 1)."""
    if not items or fraction <= 0:
        return []
    count = min(len(items), max(1, math.floor(fraction * len(items) + 0.5)))
    return rng.sample(list(items), count)


def _listening_sockets(port: int) -> set[str]:
    """The `socket:[inode]` names of the TCP sockets listening on `port` (Linux /proc)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    return inodes


def _holds_one_of(pid: int, inodes: set[str]) -> bool:
    try:
        return any(os.readlink(fd) in inodes for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:  # gone meanwhile, or not ours to read
        return False


def pid_listening_on(port: int) -> int | None:
    """The PID of the process with a TCP socket listening on `port` (Linux /proc); None if none is found."""
    inodes = _listening_sockets(port)
    if not inodes:
        return None
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _holds_one_of(int(entry.name), inodes):
            return int(entry.name)
    return None


def listens_on(pid: int, port: int) -> bool:
    """Whether process `pid` itself holds a socket listening on `port` (several may, with SO_REUSEPORT)."""
    inodes = _listening_sockets(port)
    return bool(inodes) and _holds_one_of(pid, inodes)


def _signal_all(pids: Sequence[int], signum: signal.Signals, verb: str) -> FaultResult:
    done, problems = [], []
    for pid in pids:
        try:
            os.kill(pid, signum)
            done.append(pid)
        except ProcessLookupError:
            problems.append(f"{pid} not running")
        except PermissionError:
            problems.append(f"{pid} not ours to signal")
    if not done:
        return FaultResult(Outcome.FAILED, f"{verb} nothing: {', '.join(problems) or 'no PIDs'}")
    detail = f"{verb} {', '.join(map(str, done))}" + (f" ({'; '.join(problems)})" if problems else "")
    return FaultResult(Outcome.APPLIED, detail, tuple(done))


def kill(pids: Sequence[int]) -> FaultResult:
    return _signal_all(pids, signal.SIGKILL, "SIGKILL")


def pause(pids: Sequence[int]) -> FaultResult:
    return _signal_all(pids, signal.SIGSTOP, "SIGSTOP")


def resume(pids: Sequence[int]) -> FaultResult:
    return _signal_all(pids, signal.SIGCONT, "SIGCONT")


def restart(member: Member, log_path: str | None = None) -> FaultResult:
    """Starts the member's restart command in a session of its own, so it outlives this run."""
    if not member.restart_command:
        return FaultResult(Outcome.SKIPPED, f"{member.label()}: no restart command given")
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    try:
        member.started = subprocess.Popen(list(member.restart_command), stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as error:
        return FaultResult(Outcome.FAILED, f"{member.label()}: cannot run {shlex.join(member.restart_command)}: "
                                           f"{error.strerror}")
    finally:
        if log_path:
            log.close()  # type: ignore[union-attr]
    member.killed = False
    return FaultResult(Outcome.APPLIED, f"{member.label()}: started pid {member.started.pid}", (member.started.pid,))


# The pressure workers run in their own interpreters and stop themselves after their duration,
# so pressure never outlives its step even if the experiment dies.
_CPU_WORKER = """
import sys, time
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    pass
print(time.process_time(), flush=True)
"""
_MEMORY_WORKER = """
import sys, time
held = bytearray(int(sys.argv[1]) * 1024 * 1024)
for offset in range(0, len(held), 4096):
    held[offset] = 1  # touch every page so the memory is resident, not just reserved
rss_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:"))
print(rss_kb / 1024, flush=True)
time.sleep(float(sys.argv[2]))
"""


def _stop_all(procs: Sequence[asyncio.subprocess.Process]) -> None:
    for proc in procs:
        if proc.returncode is None:
            try:
                proc.kill()
            except ProcessLookupError:
                pass


async def cpu_pressure(workers: int, duration_s: float, near_pid: int | None = None) -> FaultResult:
    """`workers` busy loops for `duration_s`, pinned to the CPUs `near_pid` may run on where the OS allows."""
    procs = [await asyncio.create_subprocess_exec(sys.executable, "-c", _CPU_WORKER, str(duration_s),
                                                  stdout=subprocess.PIPE) for _ in range(workers)]
    placement = "unpinned"
    if near_pid is not None:
        try:
            cpus = os.sched_getaffinity(near_pid)
            for proc in procs:
                os.sched_setaffinity(proc.pid, cpus)
            placement = f"pinned to CPUs {sorted(cpus)} of pid {near_pid}"
        except (AttributeError, OSError) as error:  # not Linux, or the target is gone
            placement = f"unpinned ({type(error).__name__}: {error})"
    try:
        outputs = await asyncio.gather(*(proc.communicate() for proc in procs))
    finally:
        _stop_all(procs)  # when cancelled: the workers go with the step, not at their own deadline
    cpu_s = sum(float(out.strip() or 0) for out, _ in outputs)
    return FaultResult(Outcome.APPLIED, f"{workers} busy worker(s) for {duration_s:g} s, {placement}; "
                                        f"burnt {cpu_s:.1f} CPU s", tuple(p.pid for p in procs), {"cpu_s": cpu_s})


async def memory_pressure(megabytes: int, duration_s: float) -> FaultResult:
    """Holds `megabytes` resident in a worker for `duration_s`; reports the resident size it reached."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _MEMORY_WORKER, str(megabytes),
                                                str(duration_s), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        first_line = await proc.stdout.readline()
        _, stderr = await proc.communicate()
    finally:
        _stop_all([proc])
    if proc.returncode != 0 or not first_line.strip():
        reason = stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return FaultResult(Outcome.FAILED, f"could not hold {megabytes} MB: {reason[0]}", (proc.pid,))
    rss_mb = float(first_line)
    return FaultResult(Outcome.APPLIED, f"held {rss_mb:.0f} MB resident for {duration_s:g} s", (proc.pid,),
                       {"rss_mb": rss_mb})


def delete_pods(namespace: str, selector: str, fraction: float, rng: random.Random) -> FaultResult:
    """Deletes a fraction of the pods matching `selector`, with no grace period, through the official
    client; skipped (never failed) where the client or a cluster configuration is missing. Blocking."""
    try:
        from kubernetes import client, config
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError as TransportError
    except ImportError:
        return FaultResult(Outcome.SKIPPED, "the official Kubernetes client is not installed "
                                            "(pip install 'tidegate[kubernetes]')")
    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as error:
            return FaultResult(Outcome.SKIPPED, f"no Kubernetes configuration (not in a pod, no usable kubeconfig): "
                                                f"{error}")
    api = client.CoreV1Api()
    try:
        pods = api.list_namespaced_pod(namespace, label_selector=selector, _request_timeout=10).items
        live = [pod.metadata.name for pod in pods if pod.metadata.deletion_timestamp is None]
        chosen = choose_fraction(live, fraction, rng)
        for name in chosen:
            api.delete_namespaced_pod(name, namespace, grace_period_seconds=0, _request_timeout=10)
    except ApiException as error:
        return FaultResult(Outcome.FAILED, f"pods {selector!r} in {namespace}: API answered {error.status} "
                                           f"{error.reason}")
    except (OSError, TransportError) as error:  # the cluster did not answer
        return FaultResult(Outcome.FAILED, f"pods {selector!r} in {namespace}: cluster unreachable: {error}")
    if not chosen:
        return FaultResult(Outcome.SKIPPED, f"no live pods match {selector!r} in {namespace}")
    return FaultResult(Outcome.APPLIED, f"deleted {len(chosen)} of {len(live)} pods: {', '.join(chosen)}")
