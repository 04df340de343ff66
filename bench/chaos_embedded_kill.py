"""The embedded kill-20 % scenario of `bench/chaos.py` (`--only embedded-kill20`): a pool of five
`tidegate engine` workers (one thread each, no spare) under streaming load at 70 % of what the five
were measured to serve; one worker (20 %) is SIGKILLed at 4 s and its supervisor restarts it. The
load is bounded (12 s plus a 2 s tail). Prints the requests served and failed and the success %,
the capacity the load was sized from, and the gateway's stream failovers; bar: success >= 99.5 %.

On a machine with fewer cores than workers the five share the cores, so the kill takes a fifth of
the slots but little of the compute: the test is that no request is lost to it, not a capacity
step (the mock `kill` scenario measures that)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import yaml
from chaos_embedded import MODEL, _replicas, _wait_health, worker_kill_experiment
from chaos_kit import BenchOptions, Processes, bar, free_port, outcome_line, scrape, total

from tidegate.chaos.report import build_report
from tidegate.chaos.runner import run_experiment

WORKERS = 5
WORKER_SLOTS = 2
MAX_TOKENS = 16
KILL_AT_S, DURATION_S = 4.0, 12.0


def _config(options: BenchOptions, log_dir: Path, name: str, port: int) -> str:
    path = log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "server": {"port": port, "access_log": True},  # each failure's status and replica, in the log
        "health": {"interval_s": 0.5, "cooldown_s": 5},
        "overload_control": options.overload_control,
        "pools": [{"name": MODEL, "backends": [{"type": "embedded", "model": MODEL, "count": WORKERS,
                                                "threads": 1, "slot_limit": WORKER_SLOTS}]}]}))
    return str(path)


def _measure_capacity_rps(base: str, clients: int, seconds: float = 4.0) -> float:
    """Answers per second with `clients` closed-loop clients (every slot of the pool kept busy)."""
    done = [0]
    until = time.monotonic() + seconds
    body = json.dumps({"model": MODEL, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                       "messages": [{"role": "user", "content": "tell me a story"}]}).encode()

    def client() -> None:
        while time.monotonic() < until:
            request = urllib.request.Request(f"{base}/v1/chat/completions", body, {"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                response.read()
            done[0] += 1

    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return done[0] / (time.monotonic() - started)


def _failovers(base: str) -> dict[str, float]:
    metrics = scrape(f"{base}/metrics")
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if name.split("{")[0] == "tidegate_stream_failovers_total":
            outcome = name.partition('outcome="')[2].partition('"')[0] or "all"
            out[outcome] = out.get(outcome, 0.0) + value
    out["retries"] = total(metrics, "tidegate_upstream_retries_total")
    return out


async def scenario_embedded_kill20(options: BenchOptions, procs: Processes, log_dir: Path) -> dict:
    arm = "on" if options.overload_control else "off"
    print(f"\n[5] embedded-kill20: {WORKERS} `{MODEL}` workers (1 thread, slot_limit {WORKER_SLOTS} each, no spare) "
          f"on this machine's cores, one (20 %) SIGKILLed at {KILL_AT_S:g} s under load; overload control {arm}")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    name = f"gw-embedded-kill20-{arm}"
    gateway = procs.start(name, "serve", "--config", _config(options, log_dir, name, port), ready_url=f"{base}/ready")
    try:
        _wait_health(base, ["healthy"] * WORKERS, timeout_s=300.0)
        capacity_rps = _measure_capacity_rps(base, WORKERS * WORKER_SLOTS)
        rate = 0.7 * capacity_rps
        victim = _replicas(base)[0]["replica"].rpartition("@")[2]
        before = _failovers(base)
        experiment = worker_kill_experiment(f"bench-embedded-kill20-{arm}", base, rate, DURATION_S, seed=5,
                                            interval_s=0.25, victim=victim, kill_at_s=KILL_AT_S,
                                            kill={"target": "worker", "fraction": 0.2})
        result = await run_experiment(experiment, log_dir=str(log_dir))
        after = _failovers(base)
        summary = build_report(result)["summary"]
        kill = next(e for e in result.timeline if e.action == "kill")
        growth = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
        failed = summary["requests"] - summary["ok"]
        print(f"  measured capacity {capacity_rps:.1f}/s with {WORKERS} workers, load {rate:.1f}/s (70 %); killed "
              f"{victim} at {kill.t_s:.2f} s ({kill.outcome.value}: {kill.detail})")
        print(f"  {outcome_line(summary)}")
        print(f"  served {summary['ok']} of {summary['requests']}, failed {failed}; gateway: streams failed over "
              f"{growth.get('resumed', 0):.0f}, failover failed {growth.get('failed', 0):.0f}, retries "
              f"{growth.get('retries', 0):.0f}")
        for record in result.records:
            if not record.ok:  # where a failure came from: its status, reason and send time
                print(f"    failed: status {record.status}, reason {record.reason}, sent at "
                      f"{record.sent_s + result.record_offset_s:.2f} s, e2e {record.e2e_s}")
        bar(f"embedded kill 20 %, control {arm}: success %", summary["success_pct"], ">= 99.5",
            summary["success_pct"] >= 99.5, f"served {summary['ok']}/{summary['requests']}, hung {summary['hung']}")
        return {"summary": summary, "failovers": growth, "capacity_rps": capacity_rps}
    finally:
        procs.stop(gateway)
