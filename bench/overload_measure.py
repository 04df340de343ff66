"""The overload bench's workload and measurements: open and closed loops, floods from a process of
their own, TTFT percentiles and served counts, replica drains, and the gateway's gauges and counters
read from /metrics. `bench/overload.py` sets up the bars with these.

Run as a script only by `run_open_beside_flood` (`--flood SPEC`): it sends one flood phase and exits.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tidegate.loadgen.arrivals import Poisson
from tidegate.loadgen.driver import Driver, RunConfig
from tidegate.loadgen.http_client import parse_url
from tidegate.loadgen.mix import LengthDistribution, Tenant
from tidegate.loadgen.plan import TrafficStream, build_plan
from tidegate.loadgen.records import RequestRecord
from tidegate.policy.tiers import default_tiers
from tidegate.ports import free_port

EMBEDDED_MODEL = "tiny-random-llama"
TOKENS, PROMPT_TOKENS = 16, 64  # every request: a 64-token prompt, 16 tokens answered
TTFT_TARGET_S = {tier.name: tier.ttft_target_s for tier in default_tiers()}

TENANTS = {  # name -> tier; keys are "sk-<name>"
    "gold": "critical",
    "free": "sheddable",
    "t1": "standard", "t2": "standard", "t3": "standard", "noisy": "standard",
}


def tenant(name: str) -> Tenant:
    return Tenant(name=name, api_key=f"sk-{name}", tier=TENANTS[name])


# ---- processes -----------------------------------------------------------------------------------

def wait_ok(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


# the gateways here give tenants keys, which closes /metrics to anonymous callers: they are
# configured with this key for it (server.metrics_api_key); other servers ignore the header
METRICS_KEY = "bench-metrics"


def http_text(url: str, data: bytes | None = None) -> str:
    request = urllib.request.Request(url, data=data, headers={"Authorization": f"Bearer {METRICS_KEY}"})
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.read().decode()


class Processes:
    def __init__(self) -> None:
        self.started: list[subprocess.Popen] = []

    def start(self, argv: list[str], ready_url: str) -> subprocess.Popen:
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.started.append(process)
        wait_ok(ready_url)
        return process

    def stop_all(self) -> None:
        for process in reversed(self.started):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.started:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


# ---- measurement ---------------------------------------------------------------------------------

@dataclass
class Phase:
    records: list[RequestRecord]
    elapsed_s: float
    flood_served: dict[str, tuple[int, int]] | None = None  # tenant -> (ok, sent) of a flood sent elsewhere
    started_s: float = 0.0  # time.monotonic() when its requests began (their sent_s count from it)


async def run_open_beside_flood(url: str, measured: list[tuple[str, float]], flood: list[tuple[str, float]],
                                duration_s: float, seed: int) -> Phase:
    """`measured` streams from this process while `flood` streams come from another one.

    A flood comes from other clients: sent from this process, its responses (mostly instant
    refusals, tens a second) would queue in this event loop ahead of the measured tenants' first
    tokens and add the generator's own lag to their TTFT, for FIFO and tidegate alike.
    """
    spec = json.dumps({"url": url, "streams": flood, "duration_s": duration_s, "seed": seed + 1})
    flooder = await asyncio.create_subprocess_exec(sys.executable, str(Path(__file__).resolve()), "--flood", spec,
                                                   stdout=asyncio.subprocess.PIPE)
    assert flooder.stdout is not None
    try:
        await flooder.stdout.readline()  # "ready": imported and planned, about to send
        phase = await run_open(url, measured, duration_s, seed)
        out, _ = await flooder.communicate()
    finally:
        if flooder.returncode is None:  # the run was cancelled: the flood stops with it
            flooder.kill()
            await flooder.wait()
    phase.flood_served = {tenant: (ok, sent) for tenant, (ok, sent) in json.loads(out.decode().strip()).items()}
    return phase


async def flood_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    streams = [(name, rate) for name, rate in spec["streams"]]
    print("ready", flush=True)
    phase = await run_open(spec["url"], streams, spec["duration_s"], spec["seed"])
    counts: dict[str, list[int]] = {}
    for record in phase.records:
        count = counts.setdefault(record.tenant, [0, 0])
        count[0] += record.ok
        count[1] += 1
    print(json.dumps(counts), flush=True)
    return 0


async def run_open(url: str, streams: list[tuple[str, float]], duration_s: float, seed: int) -> Phase:
    plan = build_plan([TrafficStream(Poisson(rate), (tenant(name),), LengthDistribution("const", PROMPT_TOKENS),
                                     LengthDistribution("const", TOKENS)) for name, rate in streams if rate > 0],
                      np.random.default_rng(seed), duration_s=duration_s)
    driver = Driver(RunConfig(targets=(parse_url(url),), model="m", stream=True, timeout_s=15.0, ignore_eos=True), plan)
    started_s = time.monotonic()
    result = await driver.run()
    return Phase(result.records, duration_s, started_s=started_s)


async def run_closed(url: str, name: str, concurrency: int, duration_s: float, model: str = "m") -> Phase:
    plan = build_plan([TrafficStream(Poisson(1000.0), (tenant(name),), LengthDistribution("const", PROMPT_TOKENS),
                                     LengthDistribution("const", TOKENS))], np.random.default_rng(0),
                      duration_s=duration_s * 2)
    driver = Driver(RunConfig(targets=(parse_url(url),), model=model, stream=True, timeout_s=15.0, ignore_eos=True,
                              concurrency=concurrency, duration_s=duration_s), plan)
    result = await driver.run()
    return Phase(result.records, result.elapsed_s)


def goodput_rps(phase: Phase, tenants: set[str] | None = None) -> float:
    good = sum(1 for r in phase.records if (tenants is None or r.tenant in tenants) and r.ok
               and r.ttft_s is not None and r.ttft_s <= TTFT_TARGET_S[r.tier])
    return good / phase.elapsed_s


def p99_ttft(phase: Phase, tenants: set[str], sent_from_s: float = 0.0, sent_to_s: float = math.inf) -> float:
    """P99 TTFT of `tenants`' answered requests sent in [sent_from_s, sent_to_s) of the phase; nan if none."""
    values = [r.ttft_s for r in phase.records if r.tenant in tenants and r.ok and r.ttft_s is not None
              and sent_from_s <= r.sent_s < sent_to_s]
    return float(np.percentile(values, 99)) if values else math.nan


def ttft_summary(phase: Phase, tenants: set[str]) -> str:
    values = [r.ttft_s * 1000 for r in phase.records if r.tenant in tenants and r.ok and r.ttft_s is not None]
    return "/".join(f"{v:.0f}" for v in np.percentile(values, [50, 90, 99])) if values else "-"


def slowest(phase: Phase, tenants: set[str], count: int = 4) -> str:
    mine = sorted((r for r in phase.records if r.tenant in tenants and r.ok and r.ttft_s is not None),
                  key=lambda r: r.ttft_s, reverse=True)[:count]
    return ", ".join(f"{r.sent_s:.1f}/{r.ttft_s * 1000:.0f}/{(r.sent_s - r.scheduled_s) * 1000:.0f}" for r in mine)


def served(phase: Phase, tenants: set[str]) -> str:
    if phase.flood_served and tenants <= phase.flood_served.keys():
        ok, sent = (sum(phase.flood_served[t][i] for t in tenants) for i in (0, 1))
        return f"{ok}/{sent} ok"
    mine = [r for r in phase.records if r.tenant in tenants]
    ok = sum(1 for r in mine if r.ok)
    failed: dict[str, int] = {}
    for r in mine:
        if not r.ok:
            why = f"{r.status} {r.headers.get('x-tidegate-degradation') or r.reason or ''}".strip()
            failed[why] = failed.get(why, 0) + 1
    detail = ", ".join(f"{count} {why}" for why, count in sorted(failed.items(), key=lambda kv: -kv[1]))
    return f"{ok}/{len(mine)} ok" + (f" ({detail})" if detail else "")


def engine_sequences(upstreams: list[str]) -> tuple[float, float]:
    """Sequences the replicas run and hold waiting, summed over them."""
    running = waiting = 0.0
    for url in upstreams:
        text = http_text(url.removesuffix("/v1") + "/metrics")
        # the knee mock's gauges, or the embedded engine's
        for match in re.finditer(r"^(?:knee_|tidegate_engine_)(running|waiting)(?:_sequences)? (\S+)", text, re.M):
            if match.group(1) == "running":
                running += float(match.group(2))
            else:
                waiting += float(match.group(2))
    return running, waiting


def drain(upstreams: list[str], timeout_s: float = 30.0) -> None:
    """Waits until the replicas hold nothing, so one phase's backlog cannot slow the next."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sum(engine_sequences(upstreams)) == 0:
            return
        time.sleep(0.5)
    print(f"  (replicas still busy after {timeout_s:.0f} s)")


def histogram_p99(text: str, name: str) -> tuple[float, int]:
    buckets: list[tuple[float, float]] = []
    for le, value in re.findall(rf'^{name}_bucket{{[^}}]*le="([^"]+)"[^}}]*}} (\S+)', text, re.M):
        buckets.append((math.inf if le == "+Inf" else float(le), float(value)))
    if not buckets:
        return math.nan, 0
    merged: dict[float, float] = {}
    for le, value in buckets:
        merged[le] = merged.get(le, 0.0) + value
    ordered = sorted(merged.items())
    total = ordered[-1][1]
    if total == 0:
        return math.nan, 0
    rank = 0.99 * total
    lower_le, lower_count = 0.0, 0.0
    for le, count in ordered:
        if count >= rank:
            if math.isinf(le):
                return lower_le, int(total)
            # linear within the bucket, as Prometheus' histogram_quantile does
            return lower_le + (le - lower_le) * (rank - lower_count) / max(count - lower_count, 1e-9), int(total)
        lower_le, lower_count = le, count
    return ordered[-1][0], int(total)


def refusals(gateway: str) -> dict[str, float]:
    """The gateway's refusal and shed counts so far, by tier and reason."""
    text = http_text(gateway + "/metrics")
    counts: dict[str, float] = {}
    for labels, value in re.findall(r'^tidegate_overload_rejections_total{([^}]*)} (\S+)', text, re.M):
        named = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        key = f"{named.get('tier')} {named.get('reason')}"
        counts[key] = counts.get(key, 0.0) + float(value)
    return counts


def replica_gauge(text: str, gauge: str, label: str = "") -> dict[str, float]:
    """One per-replica gauge from a /metrics text, by replica id; `label`: only series carrying it
    (e.g. 'coefficient="fixed"')."""
    return {replica: float(value) for labels, replica, value in
            re.findall(rf'^{gauge}{{([^}}]*replica="([^"]+)"[^}}]*)}} (\S+)', text, re.M) if label in labels}


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] != "--flood":
        sys.exit("usage: overload_measure.py --flood SPEC  (started by run_open_beside_flood)")
    try:
        import uvloop

        return uvloop.run(flood_main(sys.argv[2]))
    except ImportError:
        return asyncio.run(flood_main(sys.argv[2]))


if __name__ == "__main__":
    sys.exit(main())
