"""Shared parts of `bench/chaos.py`: the sizes of the mock pool, processes started and stopped by
PID, scraping, the gateway's config, the printed bars."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import yaml

from tidegate.chaos.runner import ChaosResult
from tidegate.ports import free_port

PY = sys.executable
TOKENS, TTFT_MS, ITL_MS = 16, 50, 10
REPLICAS = 5
SLOT_LIMIT = 2
SERVICE_S = (TTFT_MS + (TOKENS - 1) * ITL_MS) / 1000  # one answer: 0.2 s
CAPACITY_RPS = REPLICAS * SLOT_LIMIT / SERVICE_S  # 50/s
RESULTS: list[tuple[str, bool]] = []  # every bar printed in this run: (label, passed)


@dataclass(frozen=True, slots=True)
class BenchOptions:
    # off by default: static slot limits, so the capacity is the one sized above. With it on
    # (`--overload-control`) the gateway's TTFT-driven admission held these mocks to ~1 request each
    # and refused (429/503) the rest at 40/s, so the load is no longer "near capacity" but far past it
    overload_control: bool = False
    latency_factor: float | None = None  # health.latency_factor: the latency outlier rule, off unless set
    embedded_pairs: int = 1  # the embedded scenario's pairs of arms (without, with a spare), run ABBA


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


def wait_ok(url: str, timeout_s: float = 30.0, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while http_status(url) != 200:
        if time.monotonic() > deadline or (process is not None and process.poll() is not None):
            raise RuntimeError(f"{url} did not answer 200")
        time.sleep(0.1)


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        lines = response.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line and line[0] != "#"}


def total(metrics: dict[str, float], prefix: str) -> float:
    return sum(value for name, value in metrics.items() if name.split("{")[0] == prefix)


def mock_requests(port: int) -> float:
    try:
        return total(scrape(f"http://127.0.0.1:{port}/metrics"), "mock_api_requests_total")
    except OSError:
        return float("nan")  # not running (killed)


class Processes:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.all: list[subprocess.Popen] = []

    def start(self, name: str, *args: str, ready_url: str | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")
        process = subprocess.Popen([PY, "-m", "tidegate", *args], stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
        log.close()
        self.all.append(process)
        if ready_url:
            wait_ok(ready_url, process=process)
        return process

    def stop(self, process: subprocess.Popen) -> None:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)

    def stop_all(self) -> None:
        for process in reversed(self.all):
            self.stop(process)


def mock_argv(port: int) -> list[str]:
    return ["mock-upstream", "--port", str(port), "--tokens", str(TOKENS), "--ttft-ms", str(TTFT_MS),
            "--itl-ms", str(ITL_MS)]


def gateway_config(options: BenchOptions, log_dir: Path, name: str, port: int, urls: list[str],
                   **server: object) -> str:
    path = log_dir / f"{name}.yaml"
    health: dict[str, object] = {"interval_s": 1, "cooldown_s": 5}
    if options.latency_factor is not None:
        health["latency_factor"] = options.latency_factor
    path.write_text(yaml.safe_dump({
        "server": {"port": port, "access_log": False, **server},
        "health": health,
        "overload_control": options.overload_control,
        "pools": [{"name": "mock", "backends": [{"type": "upstream", "url": url, "slot_limit": SLOT_LIMIT}
                                                for url in urls]}]}))
    return str(path)


def bar(label: str, value: float, text: str, ok: bool, context: str = "") -> None:
    RESULTS.append((label, ok))
    print(f"  {label:<44} {value_text(value):>10}   bar {text:<10} {'PASS' if ok else 'FAIL'}")
    if context:
        print(f"      {context}")


def value_text(value: float) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def load_spec(url: str, rate: float, seed: int = 0) -> dict:
    return {"url": url, "model": "mock", "endpoint": "chat", "stream": True, "arrival": "poisson", "rate": rate,
            "prompt_tokens": "const:32", "max_tokens": f"const:{TOKENS}", "timeout_s": 15, "seed": seed}


def outstanding_by_replica(result: ChaosResult, start_s: float = float("-inf"), end_s: float = float("inf")) -> dict:
    values: dict[str, list[float]] = defaultdict(list)
    for sample in result.samples:
        if sample.metric == "tidegate_replica_outstanding" and start_s <= sample.t_s < end_s:
            values[sample.replica.rpartition("@")[2]].append(sample.value)
    return {replica: sum(v) / len(v) for replica, v in values.items()}


def points(result: ChaosResult) -> list[tuple[float, float, object]]:
    """(sent, ended or None, record) on the run's clock."""
    out = []
    for record in result.records:
        sent = record.sent_s + result.record_offset_s
        out.append((sent, sent + record.e2e_s if record.e2e_s is not None else None, record))
    return out


def outcome_line(summary: dict) -> str:
    return (f"requests {summary['requests']}, served {summary['ok']}, hung {summary['hung']}, streams failed "
            f"{summary['streams_failed']}, refused {summary['refused']}, http errors {summary['http_errors']}, "
            f"conn errors {summary['connection_errors']}, e2e p50 {summary['e2e_p50_s'] or 0:.3f} s "
            f"p99 {summary['e2e_p99_s'] or 0:.3f} s")
