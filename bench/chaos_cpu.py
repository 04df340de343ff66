"""Per-worker CPU for `bench/chaos_embedded.py`: a thread samples, every half second, each worker
process of a gateway (its children in /proc: CPU seconds and the nice value of every thread) and each replica's health
(`/status.json`), so that a run can say how busy the serving engines were while the dead worker's
replacement loaded its model, and at which priority it loaded. Linux only; elsewhere it samples nothing."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

_TICKS_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True, slots=True)
class CpuSample:
    t_s: float  # time.monotonic()
    port: int  # the worker's port: the replica it serves, across restarts
    pid: int
    cpu_s: float  # user + system CPU of the process so far
    nices: frozenset[int]  # of every thread (a nice value is per thread: a promoted spare's must all be restored)


def _stat_fields(path: str) -> list[str]:
    return Path(path).read_text().rpartition(")")[2].split()


def _thread_nices(pid: int) -> frozenset[int]:
    nices = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            nices.add(int(_stat_fields(f"/proc/{pid}/task/{tid}/stat")[16]))
        except OSError:  # that thread ended
            continue
    return frozenset(nices)


def _worker_stat(pid: int) -> tuple[int, float, frozenset[int]] | None:
    """(port, CPU seconds, every thread's nice) of an engine process, None when it is not one (or is gone)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        fields = _stat_fields(f"/proc/{pid}/stat")
        nices = _thread_nices(pid)
    except OSError:
        return None
    if b"--port" not in argv:
        return None
    port = int(argv[argv.index(b"--port") + 1])
    return port, (int(fields[11]) + int(fields[12])) / _TICKS_S, nices


class WorkerCpu:
    def __init__(self, gateway_pid: int, base_url: str, every_s: float = 0.5) -> None:
        self._gateway_pid = gateway_pid
        self._base_url = base_url
        self._every_s = every_s
        self.samples: list[CpuSample] = []
        self.health: list[tuple[float, int, str]] = []  # (t_s, port, health)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> WorkerCpu:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        children = Path(f"/proc/{self._gateway_pid}/task/{self._gateway_pid}/children")
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                pids = [int(pid) for pid in children.read_text().split()]
            except OSError:
                return
            for pid in pids:
                stat = _worker_stat(pid)
                if stat is not None:
                    self.samples.append(CpuSample(now, stat[0], pid, stat[1], stat[2]))
            try:
                with urllib.request.urlopen(f"{self._base_url}/status.json", timeout=2) as response:
                    for replica in json.loads(response.read())["pools"][0]["replicas"]:
                        self.health.append((now, int(replica["replica"].rpartition(":")[2]), replica["health"]))
            except OSError:
                pass
            self._stop.wait(self._every_s)

    def killed_at(self, port: int) -> float | None:
        """The first sample time at which the port's first process was gone (the kill, to one sample)."""
        first = next((s for s in self.samples if s.port == port), None)
        if first is None:
            return None
        alive = {s.t_s for s in self.samples if s.pid == first.pid}
        return next((t for t in sorted({s.t_s for s in self.samples}) if t > first.t_s and t not in alive), None)

    def ready_at(self, port: int, after_s: float, health: tuple[str, ...]) -> float | None:
        """The first time after `after_s` at which the port's replica was in one of `health`."""
        return next((t for t, p, h in self.health if p == port and t > after_s and h in health), None)

    def busy(self, port: int, start_s: float, end_s: float) -> tuple[float, set[int]]:
        """The port's processes' CPU in [start_s, end_s] as a fraction of one core, and their threads'
        nice values then. A process first seen in the window counts from 0 (it started there)."""
        first_seen: dict[int, float] = {}
        for sample in self.samples:
            first_seen.setdefault(sample.pid, sample.t_s)
        inside = [s for s in self.samples if s.port == port and start_s <= s.t_s <= end_s]
        used = 0.0
        for pid in {s.pid for s in inside}:
            own = [s for s in inside if s.pid == pid]
            began = 0.0 if first_seen[pid] > start_s else own[0].cpu_s
            used += own[-1].cpu_s - began
        return (used / (end_s - start_s) if end_s > start_s else 0.0), {nice for s in inside for nice in s.nices}
