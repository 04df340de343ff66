"""Issue 5's bars, live: `tidegate serve` with overload control vs the FIFO baseline, same run.

Two gateways run side by side over the same two replicas; each phase is run on the FIFO gateway
(overload control off: FIFO queue, static slot limit) and then on tidegate (overload control on),
alternating, with the replicas drained in between. Figures printed:

  capacity    completed req/s of a closed loop past the replicas' knee
  goodput     requests that finish and meet their tier's TTFT target, per second, at 1x/2x/4x capacity;
              bar: tidegate at 2x and 4x >= 90 % of its goodput at 1x (FIFO printed beside)
  critical    critical P99 TTFT during a 3x sheddable burst vs critical alone; bar <= 1.5x
  noisy       other tenants' P99 TTFT while one tenant sends 10x its share vs all at a fair load; bar < +20 %
  rejection   p99 of the gateway's own arrival-to-answer time of admission refusals; bar < 5 ms
  slots       a replica slowed 2x: its slot limit trace; bar: within +-25 % of the new best in 30 s

Replicas (`--replicas`): `embedded` (default) runs two `tidegate engine` processes (the engine
`tidegate serve` starts for its embedded pool; started here as upstreams so that both gateways share
them, the bench can drain them between phases, and `--fault-injection` can slow one 2x), one torch
thread each; the gateways and the load generator share the same 2 cores, so the engines slow down
as offered load rises, and the figures include that. The slot targets come from the replicas
themselves: the base target is the p90 TTFT at which they delivered their capacity, the best
tier's 1.15x their p90 TTFT at a quarter of it; the slowed replica's new best limit is measured by
a concurrency sweep. `knee-mock` runs `bench/overload_knee_mock.py`, a modelled batching engine
with a flat knee (no prefill cost, no KV limit), whose best limits are known in closed form.

Run: flock /tmp/tidegate-bench.lock python bench/overload.py [--phase-s 12] [--only critical|goodput|noisy]
       [--replicas knee-mock|embedded]
(`--only`: capacity and that bar alone, for iterating; not a verdict on all bars)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from tidegate.loadgen.arrivals import Poisson
from tidegate.loadgen.driver import Driver, RunConfig
from tidegate.loadgen.http_client import parse_url
from tidegate.loadgen.mix import LengthDistribution, Tenant
from tidegate.loadgen.plan import TrafficStream, build_plan
from tidegate.loadgen.records import RequestRecord
from tidegate.policy.tiers import default_tiers

HERE = Path(__file__).resolve().parent
KNEE, STEP_MS, MAX_RUNNING, TOKENS, PROMPT_TOKENS = 4, 25.0, 64, 16, 64
EMBEDDED_MODEL = "tiny-random-llama"
REPLICAS = 2
# the slot limit's latency target: just above the unloaded p90 TTFT (about 1.9 steps), so each
# replica is kept at its knee, where throughput is full and latency still flat
SLOT_TARGET_S = 0.06
# while critical traffic is present the limit aims at this instead: about the unloaded p90 TTFT at
# the knee (1.9 steps of 25 ms = 48 ms), so a critical request joins a batch no longer than the knee
BEST_TIER_SLOT_TARGET_S = 0.055
# slots per replica above the limit for the critical tier: its usual concurrency (0.25x capacity
# of critical traffic holds about one request per replica) plus one
PRIORITY_HEADROOM = 2
# the adaptive-slots phase runs on its own gateway with a target past the knee, where the best
# limit is well above the minimum and halves when the replica is slowed 2x
SLOWDOWN_SLOT_TARGET_S = 0.2
TTFT_TARGET_S = {tier.name: tier.ttft_target_s for tier in default_tiers()}

TENANTS = {  # name -> tier; keys are "sk-<name>"
    "gold": "critical",
    "free": "sheddable",
    "t1": "standard", "t2": "standard", "t3": "standard", "noisy": "standard",
}


def tenant(name: str) -> Tenant:
    return Tenant(name=name, api_key=f"sk-{name}", tier=TENANTS[name])


# ---- processes -----------------------------------------------------------------------------------

def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


def http_text(url: str, data: bytes | None = None) -> str:
    with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=5) as response:
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


def gateway_config(port: int, upstreams: list[str], overload: bool, slot_target_s: float = SLOT_TARGET_S,
                   best_tier_target_s: float = BEST_TIER_SLOT_TARGET_S, upstream_model: str | None = None) -> dict:
    config: dict = {
        "server": {"port": port, "access_log": False, "queue_timeout_s": 30.0},
        # forward_priority: the embedded engine schedules by the tier's rank (the knee mock ignores it)
        "pools": [{"name": "m", "backends": [{"type": "upstream", "url": url, "health_path": "/health",
                                               "model": upstream_model, "forward_priority": True}
                                              for url in upstreams]}],
        "tenants": {name: {"api_keys": [f"sk-{name}"], "tier": tier} for name, tier in TENANTS.items()},
        "limits": {"slots": {"target_latency_s": slot_target_s, "initial": 4, "maximum": 256,
                             "priority_headroom": PRIORITY_HEADROOM,
                             "best_tier_target_latency_s": min(best_tier_target_s, slot_target_s)}},
        "overload_control": overload,
    }
    return config


# ---- measurement ---------------------------------------------------------------------------------

@dataclass
class Phase:
    records: list[RequestRecord]
    elapsed_s: float
    flood_served: dict[str, tuple[int, int]] | None = None  # tenant -> (ok, sent) of a flood sent elsewhere


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
    await flooder.stdout.readline()  # "ready": imported and planned, about to send
    phase = await run_open(url, measured, duration_s, seed)
    out, _ = await flooder.communicate()
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
    result = await driver.run()
    return Phase(result.records, duration_s)


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


def p99_ttft(phase: Phase, tenants: set[str]) -> float:
    values = [r.ttft_s for r in phase.records if r.tenant in tenants and r.ok and r.ttft_s is not None]
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


def drain(upstreams: list[str], timeout_s: float = 30.0) -> None:
    """Waits until the replicas hold nothing, so one phase's backlog cannot slow the next."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = 0.0
        for url in upstreams:
            text = http_text(url.removesuffix("/v1") + "/metrics")
            # the knee mock's gauges, or the embedded engine's
            busy += sum(float(v) for v in re.findall(
                r"^(?:knee_(?:running|waiting)|tidegate_engine_(?:running|waiting)_sequences) (\S+)", text, re.M))
        if busy == 0:
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


def replica_gauge(text: str, gauge: str) -> dict[str, float]:
    """One per-replica gauge from a /metrics text, by replica id."""
    return {replica: float(value) for replica, value in
            re.findall(rf'^{gauge}{{[^}}]*replica="([^"]+)"[^}}]*}} (\S+)', text, re.M)}


def slot_limits(gateway: str) -> dict[str, float]:
    return replica_gauge(http_text(gateway + "/metrics"), "tidegate_replica_slot_limit")


SWEEP_CONCURRENCY = (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32)


async def best_limit(replica: str, other: str, other_concurrency: int, target_s: float, point_s: float = 6.0,
                     warmup_s: float = 1.5) -> tuple[float, list[tuple[int, float]]]:
    """The largest concurrency at which `replica`'s p90 TTFT meets `target_s`, measured directly.

    A closed loop at each concurrency of a grid (samples from its first `warmup_s` dropped), while a
    closed loop holds `other_concurrency` requests on the other replica, as the gateway's load does,
    so the two replicas share the cores much as they did under the gateway. Linear between the last
    grid point that meets the target and the first that misses it.
    """
    curve: list[tuple[int, float]] = []
    for concurrency in SWEEP_CONCURRENCY:
        mine, _ = await asyncio.gather(run_closed(replica, "t1", concurrency, point_s, model=EMBEDDED_MODEL),
                                       run_closed(other, "t2", other_concurrency, point_s, model=EMBEDDED_MODEL))
        ttfts = [r.ttft_s for r in mine.records if r.ok and r.ttft_s is not None and r.sent_s >= warmup_s]
        curve.append((concurrency, float(np.percentile(ttfts, 90)) if ttfts else math.inf))
        if curve[-1][1] > 1.5 * target_s:
            break
    best = float(curve[0][0]) if curve[0][1] > target_s else float(SWEEP_CONCURRENCY[-1])
    for (c0, l0), (c1, l1) in zip(curve, curve[1:]):
        if l0 <= target_s < l1:
            best = c0 + (c1 - c0) * (target_s - l0) / (l1 - l0)
            break
    return best, curve


async def noisy_tenant_bar(both, capacity: float, standard: list[str], phase_s: float) -> bool:
    """Other tenants' P99 TTFT while one tenant sends 10x its share, vs all at a fair load."""
    ok = True
    share = capacity / len(standard)
    others = {"t1", "t2", "t3"}
    # fair: every tenant sends its share (together: capacity); noisy: one sends 10x its share. Long
    # enough for ~500 of the others' requests a phase: at capacity their P99 is a queueing tail
    noisy_s = max(phase_s, 500.0 / (len(others) * share))
    fair = await both([(name, share) for name in standard], seed=201, duration_s=noisy_s)
    noisy = await both([(name, share) for name in others], seed=202, duration_s=noisy_s,
                       flood=[("noisy", 10 * share)])
    for mode in ("fifo", "tidegate"):
        before, during = p99_ttft(fair[mode], others), p99_ttft(noisy[mode], others)
        rise = during / before - 1.0
        verdict = "" if mode == "fifo" else f" (bar < +20 %: {'PASS' if rise < 0.2 else 'FAIL'})"
        ok &= mode == "fifo" or rise < 0.2
        print(f"others' P99 TTFT {mode}: fair {before * 1000:.0f} ms, noisy tenant at 10x share "
              f"{during * 1000:.0f} ms -> {rise * 100:+.0f} %{verdict}  [others {served(noisy[mode], others)}, "
              f"noisy {served(noisy[mode], {'noisy'})}; {noisy_s:.0f} s phases]")
        print(f"  others' TTFT p50/p90/p99 ms: fair {ttft_summary(fair[mode], others)}, "
              f"noisy {ttft_summary(noisy[mode], others)}")
    return ok


# ---- the run -------------------------------------------------------------------------------------

async def main_async(phase_s: float, only: str | None = None, replicas: str = "embedded") -> int:
    processes = Processes()
    # SIGTERM (a `kill`, a CI timeout) cancels the run, so the replicas and gateways started here stop too
    main_task, loop = asyncio.current_task(), asyncio.get_running_loop()
    assert main_task is not None
    signal.signal(signal.SIGTERM, lambda *_: loop.call_soon_threadsafe(main_task.cancel))
    try:
        return await _run(processes, phase_s, only, replicas)
    finally:
        processes.stop_all()


def start_replicas(processes: Processes, kind: str) -> list[str]:
    upstreams: list[str] = []
    for _ in range(REPLICAS):
        port = free_port()
        if kind == "embedded":
            # one torch thread each: the two replicas, the gateway and the load generator share 2 cores
            # --fault-injection: POST /admin/slow makes every step 2x slower for the adaptive-slots bar
            argv = [sys.executable, "-m", "tidegate", "engine", "--model", EMBEDDED_MODEL, "--threads", "1",
                    "--port", str(port), "--fault-injection"]
        else:
            argv = [sys.executable, str(HERE / "overload_knee_mock.py"), "--port", str(port), "--knee", str(KNEE),
                    "--step-ms", str(STEP_MS), "--max-running", str(MAX_RUNNING), "--tokens", str(TOKENS)]
        processes.start(argv, f"http://127.0.0.1:{port}/health")
        upstreams.append(f"http://127.0.0.1:{port}/v1")
    return upstreams


def start_gateway(processes: Processes, workdir: Path, mode: str, config: dict) -> str:
    path = workdir / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True))
    port = config["server"]["port"]
    processes.start([sys.executable, "-m", "tidegate", "serve", "--config", str(path), "--no-access-log",
                     "--log-level", "warning"], f"http://127.0.0.1:{port}/ready")
    return f"http://127.0.0.1:{port}"


async def _run(processes: Processes, phase_s: float, only: str | None, replicas: str) -> int:
    embedded = replicas == "embedded"
    upstreams = start_replicas(processes, replicas)
    model = EMBEDDED_MODEL if embedded else None
    workdir = Path(tempfile.mkdtemp(prefix="tidegate-overload-"))
    gateways = {"fifo": start_gateway(processes, workdir, "fifo",
                                      gateway_config(free_port(), upstreams, False, upstream_model=model))}
    if embedded:
        print(f"replicas: {REPLICAS} x `tidegate engine --model {EMBEDDED_MODEL} --threads 1`, {TOKENS} tokens/answer, "
              f"{PROMPT_TOKENS}-token prompts; cpu cores: {os.cpu_count()}; phase {phase_s:.0f} s")
        print("NOTE: replicas, gateway and load generator share the cores: the engines' steps slow down as the "
              "generator's load rises, which the figures include")
    else:
        print(f"replicas: {REPLICAS} x knee mock (knee {KNEE} running, step {STEP_MS:.0f} ms, engine cap {MAX_RUNNING}, "
              f"{TOKENS} tokens/answer); cpu cores: {os.cpu_count()}; phase {phase_s:.0f} s")
        print("LIMITATION: replicas are a modelled batching engine (bench/overload_knee_mock.py), not the embedded "
              "engine: no prompt-length prefill cost, no KV limit (`--replicas embedded` runs the real engine)")
    in_flight = REPLICAS * KNEE * 4
    capacity_phase = await run_closed(gateways["fifo"], "t1", concurrency=in_flight, duration_s=phase_s)
    capacity = sum(1 for r in capacity_phase.records if r.ok) / capacity_phase.elapsed_s
    theoretical = "" if embedded else f"; model says {REPLICAS * KNEE / (STEP_MS / 1000.0) / TOKENS:.1f}"
    print(f"capacity: {capacity:.1f} req/s measured (closed loop, {in_flight} in flight){theoretical}")
    drain(upstreams)
    slot_target_s, best_tier_target_s = SLOT_TARGET_S, BEST_TIER_SLOT_TARGET_S
    if embedded:
        # no analytic knee: the targets are set from the replicas' TTFT at a quarter of capacity,
        # in the same proportions as the knee mock's (60 ms and 55 ms over its 48 ms p90)
        probe = await run_open(gateways["fifo"], [("t1", 0.25 * capacity)], phase_s, seed=7)
        drain(upstreams)
        unloaded_p90_s = float(np.percentile([r.ttft_s for r in probe.records if r.ok and r.ttft_s is not None], 90))
        # A real engine has no flat knee: its throughput keeps rising with the batch while latency
        # rises too, so a target near the unloaded latency would hold it far below capacity. The
        # base target is the p90 TTFT at which it delivered its capacity; the best tier's target
        # stays near the unloaded latency (the critical bar compares with critical traffic alone).
        at_capacity_p90_s = float(np.percentile(
            [r.ttft_s for r in capacity_phase.records if r.ok and r.ttft_s is not None], 90))
        best_tier_target_s = 1.15 * unloaded_p90_s
        slot_target_s = max(at_capacity_p90_s, best_tier_target_s)
        print(f"slot targets: {slot_target_s * 1000:.0f} ms (p90 TTFT at capacity), best tier "
              f"{best_tier_target_s * 1000:.0f} ms (1.15 x the p90 TTFT {unloaded_p90_s * 1000:.0f} ms at 0.25x)")
    gateways["tidegate"] = start_gateway(processes, workdir, "tidegate", gateway_config(
        free_port(), upstreams, True, slot_target_s, best_tier_target_s, upstream_model=model))
    # the adaptive-slots phase: a gateway of its own whose target lies past the knee, where the best
    # limit is well above the minimum and falls when a replica is slowed 2x. On the engine, twice the
    # base target: the slowed replica's best then lies near the capacity run's concurrency, where its
    # latency climbs steeply with concurrency; at the base target it would lie in the flat stretch
    # below, where a few ms of noise move the "best" by half
    slowdown_target_s = 2.0 * slot_target_s if embedded else SLOWDOWN_SLOT_TARGET_S
    if only is None:
        gateways["slowdown"] = start_gateway(processes, workdir, "slowdown", gateway_config(
            free_port(), upstreams, True, slowdown_target_s, upstream_model=model))

    async def both(streams: list[tuple[str, float]], seed: int, duration_s: float = phase_s,
                   flood: list[tuple[str, float]] | None = None) -> dict[str, Phase]:
        out = {}
        for mode in ("fifo", "tidegate"):
            load = asyncio.create_task(
                run_open(gateways[mode], streams, duration_s, seed) if not flood
                else run_open_beside_flood(gateways[mode], streams, flood, duration_s, seed))
            limits: list[float] = []
            refused_before = refusals(gateways[mode]) if mode == "tidegate" else {}
            while mode == "tidegate" and not load.done():
                await asyncio.sleep(1.0)
                limits.append(sum((await asyncio.to_thread(slot_limits, gateways[mode])).values()))
            out[mode] = await load
            if limits:
                refused = {why: count - refused_before.get(why, 0.0) for why, count in refusals(gateways[mode]).items()}
                refused_text = ", ".join(f"{count:.0f} {why}" for why, count in sorted(refused.items()) if count)
                print(f"  (tidegate's slot limits, all replicas, sampled each second: median {np.median(limits):.0f}, "
                      f"range {min(limits):.0f}-{max(limits):.0f}; refused by tier and reason: {refused_text or 'none'})")
            drain(upstreams)
        return out

    standard = ["t1", "t2", "t3", "noisy"]
    ok = True

    # -- goodput at 1x/2x/4x
    goodput: dict[float, dict[str, float]] = {}
    for factor in (1.0, 2.0, 4.0) if only in (None, "goodput") else ():
        rate = factor * capacity / len(standard)
        phases = await both([(name, rate) for name in standard], seed=int(factor * 10))
        goodput[factor] = {mode: goodput_rps(phase) for mode, phase in phases.items()}
        print(f"goodput at {factor:.0f}x ({factor * capacity:.1f} req/s offered): "
              f"FIFO {goodput[factor]['fifo']:.2f} req/s, tidegate {goodput[factor]['tidegate']:.2f} req/s  "
              f"[{served(phases['fifo'], set(standard))} | {served(phases['tidegate'], set(standard))}]")
    for factor in (2.0, 4.0) if only in (None, "goodput") else ():
        fifo_ratio = goodput[factor]["fifo"] / max(goodput[1.0]["fifo"], 1e-9)
        ratio = goodput[factor]["tidegate"] / max(goodput[1.0]["tidegate"], 1e-9)
        ok &= ratio >= 0.9
        print(f"  goodput {factor:.0f}x / 1x: tidegate {ratio:.2f} (bar >= 0.90: {'PASS' if ratio >= 0.9 else 'FAIL'}); "
              f"FIFO {fifo_ratio:.2f}")

    if only == "goodput":
        print("GOODPUT BAR " + ("PASSES" if ok else "FAILS") + " (--only goodput: the other bars were not run)")
        return 0 if ok else 1

    if only in (None, "critical"):
        # -- critical during a 3x sheddable burst; long enough for ~200 critical requests per phase, so
        # that the P99 is not just the worst one or two of them
        critical_rate = 0.25 * capacity
        critical_s = max(phase_s, 200.0 / critical_rate)
        alone = await both([("gold", critical_rate)], seed=101, duration_s=critical_s)
        burst = await both([("gold", critical_rate)], seed=102, duration_s=critical_s, flood=[("free", 3.0 * capacity)])
        for mode in ("fifo", "tidegate"):
            before, during = p99_ttft(alone[mode], {"gold"}), p99_ttft(burst[mode], {"gold"})
            ratio = during / before
            verdict = "" if mode == "fifo" else f" (bar <= 1.5: {'PASS' if ratio <= 1.5 else 'FAIL'})"
            ok &= mode == "fifo" or ratio <= 1.5
            print(f"critical P99 TTFT {mode}: alone {before * 1000:.0f} ms, during 3x sheddable burst "
                  f"{during * 1000:.0f} ms -> {ratio:.2f}x{verdict}  [gold {served(burst[mode], {'gold'})}, "
                  f"sheddable {served(burst[mode], {'free'})}; {critical_s:.0f} s phases]")
            print(f"  critical TTFT p50/p90/p99 ms: alone {ttft_summary(alone[mode], {'gold'})}, "
                  f"burst {ttft_summary(burst[mode], {'gold'})}")
            print(f"  slowest critical in the burst (sent at s, TTFT ms, generator's send lag ms): "
                  f"{slowest(burst[mode], {'gold'})}")
    if only == "critical":
        print("CRITICAL BAR " + ("PASSES" if ok else "FAILS") + " (--only critical: the other bars were not run)")
        return 0 if ok else 1
    ok &= await noisy_tenant_bar(both, capacity, standard, phase_s)
    if only == "noisy":
        print("NOISY-TENANT BAR " + ("PASSES" if ok else "FAILS") + " (--only noisy: the other bars were not run)")
        return 0 if ok else 1

    # -- rejection latency, over every tidegate phase so far
    p99_s, count = histogram_p99(http_text(gateways["tidegate"] + "/metrics"), "tidegate_overload_rejection_seconds")
    ok &= count > 0 and p99_s < 0.005
    print(f"rejections answered: {count}, p99 {p99_s * 1000:.2f} ms (gateway's own timing; bar < 5 ms: "
          f"{'PASS' if count and p99_s < 0.005 else 'FAIL'})")

    # -- adaptive slots: replica 0 slowed 2x under a 2x load
    target = gateways["slowdown"]
    replica_ids = sorted(slot_limits(target))
    slowed = replica_ids[0]
    load = asyncio.create_task(run_open(target, [(name, 2.0 * capacity / len(standard)) for name in standard],
                                        2 * phase_s + 30.0, seed=301))
    trace: list[tuple[float, dict[str, float]]] = []
    aimed: list[float] = []  # the latency the slowed replica's limit aims at, once slowed
    started = time.monotonic()
    slowed_at = started + 2 * phase_s  # time for the limits to grow from their initial value and settle
    slow_sent = False
    slow_port = re.search(r'@[^:]+:([0-9]+)', slowed).group(1)
    slow_url = f"http://127.0.0.1:{slow_port}/admin/slow"
    while not load.done():
        await asyncio.sleep(1.0)
        now = time.monotonic()
        if not slow_sent and now >= slowed_at:
            http_text(slow_url, b"2")
            slow_sent = True
        text = await asyncio.to_thread(http_text, target + "/metrics")
        trace.append((now - slowed_at, replica_gauge(text, "tidegate_replica_slot_limit")))
        if slow_sent:
            targets = replica_gauge(text, "tidegate_replica_slot_target_seconds")
            aimed.extend([targets[slowed]] if slowed in targets else [])
    await load
    drain(upstreams)
    before = [limits[slowed] for t, limits in trace if -3.0 <= t < 0 and slowed in limits]
    settled_before = float(np.median(before)) if before else math.nan
    if embedded:
        # no model of the engine: its best limit, slowed, is measured directly (see best_limit)
        mine = next(url for url in upstreams if f":{slow_port}/" in url)
        other = next(url for url in upstreams if url != mine)
        other_held = round(np.median([limits[rid] for t, limits in trace if t >= 20.0
                                      for rid in replica_ids if rid != slowed and rid in limits]))
        # the best limit for the latency the limit aims at: the target, stretched while requests wait
        aimed_s = float(np.median(aimed)) if aimed else slowdown_target_s
        best_after, curve = await best_limit(mine, other, max(1, other_held), aimed_s)
        drain(upstreams)
    http_text(slow_url, b"1")
    print(f"slot limit trace (t = s since replica {slowed} was slowed 2x; target {slowdown_target_s * 1000:.0f} "
          "ms, a gateway of its own):")
    for t, limits in trace:
        print(f"  t={t:+5.1f}  " + "  ".join(f"{rid.split('@')[0]}={limits.get(rid, math.nan):.0f}"
                                             for rid in replica_ids))
    if embedded:
        print(f"  slowed replica's p90 TTFT by concurrency, measured directly (the other replica holding "
              f"{other_held}): " + ", ".join(f"{c}: {latency * 1000:.0f} ms" for c, latency in curve))
        how = f"the largest concurrency meeting {aimed_s * 1000:.0f} ms there, what the limit aimed at"
    else:
        # The model's best limit: the largest concurrency whose p90 TTFT (about 1.9 steps: a request
        # waits for the step in progress, then its own) meets the target.
        best_after_model = SLOWDOWN_SLOT_TARGET_S * KNEE / (1.9 * STEP_MS / 1000.0 * 2.0)
        best_after = settled_before / 2.0  # step time doubles at every batch size: the best limit halves
        how = f"half of that; the mock's model says {best_after_model:.1f}"
    settle_t = next((t for t, limits in trace if t >= 0 and all(
        abs(l2[slowed] / best_after - 1.0) <= 0.25 for t2, l2 in trace if t2 >= t)), None)
    passed = settle_t is not None and settle_t <= 30.0
    ok &= passed
    print(f"  settled before slowdown {settled_before:.0f}; new best {best_after:.1f} ({how}); within +-25 % from "
          f"{'never' if settle_t is None else f't={settle_t:.1f} s'} "
          f"(bar <= 30 s: {'PASS' if passed else 'FAIL'})")
    print("ALL BARS PASS" if ok else "SOME BARS FAIL")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--phase-s", type=float, default=12.0, help="seconds of load per phase and mode")
    parser.add_argument("--only", choices=("critical", "goodput", "noisy"),
                        help="run capacity and this bar alone (for iterating)")
    parser.add_argument("--replicas", choices=("knee-mock", "embedded"), default="embedded",
                        help="real `tidegate engine` processes (default), or modelled flat-knee engines")
    parser.add_argument("--flood", help=argparse.SUPPRESS)  # internal: send a flood phase (JSON spec) and exit
    args = parser.parse_args()
    work = flood_main(args.flood) if args.flood else main_async(args.phase_s, args.only, args.replicas)
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        return run(work)
    except asyncio.CancelledError:
        print("terminated: the replicas and gateways started here are stopped", file=sys.stderr)
        return 128 + signal.SIGTERM


if __name__ == "__main__":
    sys.exit(main())
