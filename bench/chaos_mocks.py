"""The mock-pool scenarios of `bench/chaos.py`: kill one replica of five, two outliers, a gateway
restart on the same port (their bars are in chaos.py's docstring)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import yaml
from chaos_kit import (CAPACITY_RPS, PY, REPLICAS, SERVICE_S, SLOT_LIMIT, BenchOptions, Processes, bar, free_port,
                       gateway_config, http_status, load_spec, mock_argv, mock_requests, outcome_line,
                       outstanding_by_replica, points, scrape, total)

from tidegate.chaos.experiment import parse_experiment
from tidegate.chaos.process_faults import listens_on
from tidegate.chaos.report import build_report, classify
from tidegate.chaos.runner import run_experiment

# -- 1. kill one replica of five under load near capacity, restart it 20 s later
async def scenario_kill(options: BenchOptions, procs: Processes, mocks: list[int], log_dir: Path) -> None:
    rate = 0.8 * CAPACITY_RPS
    print(f"\n[1] kill 1 of {REPLICAS} replicas at 5 s, restart at 25 s; load {rate:g}/s Poisson streaming "
          f"(80 % of {CAPACITY_RPS:g}/s = {REPLICAS} replicas x slot_limit {SLOT_LIMIT} / {SERVICE_S:g} s per answer; "
          f"100 % of the 4 left)")
    port = free_port()
    gateway = procs.start("gw-kill", "serve", "--config", gateway_config(
        options, log_dir, "gw-kill", port, [f"http://127.0.0.1:{p}/v1" for p in mocks]),
        ready_url=f"http://127.0.0.1:{port}/ready")
    base = f"http://127.0.0.1:{port}"
    before = {p: mock_requests(p) for p in mocks}
    experiment = parse_experiment(yaml.safe_dump({
        "name": "bench-kill-1-of-5", "duration_s": 35, "tail_s": 2,
        "load": load_spec(base, rate),
        "gateway": {"metrics_url": f"{base}/metrics", "interval_s": 0.25},
        "targets": {"replicas": [{"port": p, "restart": " ".join([PY, "-m", "tidegate", *mock_argv(p)])}
                                 for p in mocks]},
        "steps": [{"at_s": 5, "kill": {"target": "replicas", "fraction": 0.2}},
                  {"at_s": 25, "restart": {"target": "replicas"}}]}))
    result = await run_experiment(experiment, log_dir=str(log_dir))
    procs.all.extend(result.restarted)
    report = build_report(result)
    summary = report["summary"]
    kill = next(e for e in result.timeline if e.action == "kill")
    killed = kill.addresses[0] if kill.addresses else "?"
    restart = next((e for e in result.timeline if e.action == "restart"), None)
    print(f"  kill: {kill.outcome.value} {kill.detail} ({killed}) at {kill.t_s:.2f} s; restart: "
          f"{restart.outcome.value + ' ' + restart.detail if restart else 'none'}")
    for row in (report["gateway"] or {}).get("reactions", []):
        after = f"{row['after_s']:.2f} s" if row.get("after_s") is not None else "-"
        print(f"  gateway: {row['action']} {row['replica']} {row['measure']} after {after} ({row['note']})")
    print(f"  all: {outcome_line(summary)}")
    after_counts = {p: mock_requests(p) for p in mocks}
    mean_out = outstanding_by_replica(result)
    survivors = {row["replica"].rpartition("@")[2]: row for row in (report["gateway"] or {}).get("survivors", [])}
    load_lines = []
    for p in mocks:
        address = f"127.0.0.1:{p}"
        served = (f"{after_counts[p]:.0f} req since its restart (killed: {p})" if address == killed
                  else f"{after_counts[p] - before[p]:.0f} req")
        surv = survivors.get(address)
        ratio = f", during/before {surv['ratio']:.2f}x" if surv and surv.get("ratio") else ""
        load_lines.append(f"{p}: {served}, mean outstanding {mean_out.get(address, 0):.2f}{ratio}")
    replica_load = "replica load: " + "; ".join(load_lines)
    # failures that ended within 2 s of the kill: requests on the killed replica at that moment
    cut = [record for sent, end, record in points(result) if not record.ok
           and (end if end is not None else sent) >= kill.t_s and (end if end is not None else sent) < kill.t_s + 2]
    cut_streams = sum(1 for r in cut if classify(r) == "stream_failed")
    other_failures = summary["requests"] - summary["ok"] - len(cut)
    served = f"served {summary['ok']} of {summary['requests']}"
    bar("success, all requests (%)", summary["success_pct"], ">= 99.5", summary["success_pct"] >= 99.5,
        f"{served}; {replica_load}")
    bar("hung requests", summary["hung"], "0", summary["hung"] == 0, f"{served}")
    failovers = (report["gateway"] or {}).get("stream_failovers") or {}
    print(f"  streams failed over / failed: {failovers.get('resumed', 0)} / {cut_streams} -- the gateway resumed "
          f"{failovers.get('resumed', 0)} streams broken mid-answer on another replica (not continued: "
          f"{failovers.get('refused', 0)}, continuation failed: {failovers.get('failed', 0)}); the clients saw "
          f"{cut_streams} streams fail (of {len(cut)} failures ending within 2 s of the kill; {other_failures} "
          f"other failures)")
    recovery = report.get("recovery")
    if recovery:
        print(f"  recovery: {recovery}")
    procs.stop(gateway)


# -- 2. a replica answering 500 to 30 % and another 2 s slow
# what the pool can serve once the outliers are known: three healthy replicas, the slow one at
# SERVICE_S + 2 s per answer, the failing one ejected
HEALTHY_RPS = (REPLICAS - 2) * SLOT_LIMIT / SERVICE_S
OUTLIER_CAPACITY_RPS = HEALTHY_RPS + SLOT_LIMIT / (SERVICE_S + 2.0)


async def scenario_outliers(options: BenchOptions, procs: Processes, mocks: list[int], log_dir: Path) -> None:
    # 70 % of what is left once the outliers are known, not of the five replicas: 70 % of those
    # (35/s) was 113 % of the 30.9/s left, a queue that grew for 35 s with the healthy replicas' slots
    # 99 % busy, which overload control rightly refused past the tier's wait (15-29 refused)
    rate = round(0.7 * OUTLIER_CAPACITY_RPS, 1)
    print(f"\n[2] outliers: from 5 s, replica {mocks[0]} (behind a fault proxy) answers 500 to 30 % of API "
          f"requests, replica {mocks[1]} (behind another) gets +2 s per API request, until the end (40 s); "
          f"load {rate:g}/s Poisson streaming (70 % of the {OUTLIER_CAPACITY_RPS:.1f}/s left with the outliers, "
          f"{100 * rate / CAPACITY_RPS:.0f} % of the {CAPACITY_RPS:g}/s of five)")
    proxies = {}
    for name, mock in (("err500", mocks[0]), ("slow2s", mocks[1])):
        listen, admin = free_port(), free_port()
        procs.start(f"proxy-{name}", "chaos", "proxy", "--listen", f"127.0.0.1:{listen}", "--target",
                    f"127.0.0.1:{mock}", "--admin", f"127.0.0.1:{admin}",
                    ready_url=f"http://127.0.0.1:{admin}/faults")
        proxies[name] = (listen, admin, mock)
    port = free_port()
    urls = [f"http://127.0.0.1:{proxies[n][0]}/v1" for n in ("err500", "slow2s")]
    urls += [f"http://127.0.0.1:{p}/v1" for p in mocks[2:]]
    gateway = procs.start("gw-outliers", "serve", "--config",
                          gateway_config(options, log_dir, "gw-outliers", port, urls),
                          ready_url=f"http://127.0.0.1:{port}/ready")
    base = f"http://127.0.0.1:{port}"
    fault_at, duration = 5.0, 40.0
    experiment = parse_experiment(yaml.safe_dump({
        "name": "bench-outliers", "duration_s": duration, "tail_s": 0,
        "load": load_spec(base, rate, seed=1),
        "gateway": {"metrics_url": f"{base}/metrics", "interval_s": 0.25},
        "proxies": {n: {"admin": f"http://127.0.0.1:{proxies[n][1]}"} for n in proxies},
        "steps": [{"at_s": fault_at, "proxy": {"name": "err500", "faults": {
                      "error": {"status": 500, "probability": 0.3}, "paths": ["/v1/"]}}},
                  {"at_s": fault_at, "proxy": {"name": "slow2s", "faults": {
                      "latency": {"ms": 2000, "per": ["request"]}, "paths": ["/v1/"]}}}]}))

    def counts() -> dict[str, float]:
        snapshot = {str(p): mock_requests(p) for p in mocks}
        with urllib.request.urlopen(f"http://127.0.0.1:{proxies['err500'][1]}/counters", timeout=5) as response:
            snapshot["injected"] = float(json.loads(response.read())["errors_injected"])
        return snapshot

    fault_seen = asyncio.get_running_loop().create_future()

    def on_event(event) -> None:
        if event.action == "proxy" and not fault_seen.done():
            fault_seen.set_result(time.perf_counter())

    snapshots: dict[str, dict[str, float]] = {}

    async def window_start() -> None:
        started = await fault_seen
        await asyncio.sleep(max(0.0, started + 10.0 - time.perf_counter()))
        snapshots["from"] = await asyncio.to_thread(counts)

    retries_before = total(scrape(f"{base}/metrics"), "tidegate_upstream_retries_total")
    sampler = asyncio.ensure_future(window_start())
    result = await run_experiment(experiment, log_dir=str(log_dir), on_event=on_event)
    snapshots["to"] = await asyncio.to_thread(counts)
    await sampler
    metrics = scrape(f"{base}/metrics")
    retries = total(metrics, "tidegate_upstream_retries_total") - retries_before
    report = build_report(result)
    summary = report["summary"]
    delta = {k: snapshots["to"][k] - snapshots["from"][k] for k in snapshots["to"]}
    per_replica = {str(mocks[0]): delta[str(mocks[0])] + delta["injected"]}
    per_replica.update({str(p): delta[str(p)] for p in mocks[1:]})
    window_total = sum(per_replica.values())
    fault_t = min(e.t_s for e in result.timeline if e.action == "proxy")
    mean_out = outstanding_by_replica(result, fault_t + 10)
    addresses = {str(mocks[0]): f"127.0.0.1:{proxies['err500'][0]}", str(mocks[1]): f"127.0.0.1:{proxies['slow2s'][0]}"}
    load = "; ".join(f"{p}{' (500s)' if p == str(mocks[0]) else ' (+2 s)' if p == str(mocks[1]) else ''}: "
                     f"{n:.0f} req ({100 * n / window_total:.1f} %), mean outstanding "
                     f"{mean_out.get(addresses.get(p, f'127.0.0.1:{p}'), 0):.2f}" for p, n in per_replica.items())
    replica_load = f"replica load {fault_t + 10:.0f}-{duration:.0f} s: {load}"
    for row in (report["gateway"] or {}).get("reactions", []):
        after = f"{row['after_s']:.2f} s" if row.get("after_s") is not None else "-"
        print(f"  gateway: {row['action']} {row['replica']} {row['measure']} after {after} ({row['note']})")
    print(f"  all: {outcome_line(summary)}")
    ejections = {name.split("{", 1)[1].rstrip("}"): value for name, value in metrics.items()
                 if name.startswith("tidegate_replica_ejections_total{")}
    print("  ejections: " + ("; ".join(f"{labels}: {value:.0f}" for labels, value in ejections.items()) or "none"))
    healthy_rps, outlier_capacity_rps = HEALTHY_RPS, OUTLIER_CAPACITY_RPS
    healthy_busy = [mean_out.get(f"127.0.0.1:{p}", 0.0) / SLOT_LIMIT for p in mocks[2:]]
    print(f"  capacity with the outliers: {outlier_capacity_rps:.1f}/s (3 healthy replicas {healthy_rps:g}/s, the "
          f"slow one {SLOT_LIMIT / (SERVICE_S + 2.0):.1f}/s, the failing one ejected); offered {rate:g}/s = "
          f"{100 * rate / outlier_capacity_rps:.0f} %; healthy replicas' slots busy "
          + ", ".join(f"{100 * busy:.0f} %" for busy in healthy_busy))
    served = f"served {summary['ok']} of {summary['requests']}"
    bar("success, all requests (%)", summary["success_pct"], ">= 99.5", summary["success_pct"] >= 99.5,
        f"{served}; {replica_load}")
    for name, mock, what in (("err500", mocks[0], "500 x 30 %"), ("slow2s", mocks[1], "+2 s")):
        share = 100 * per_replica[str(mock)] / window_total if window_total else float("nan")
        bar(f"share of traffic, replica {mock} ({what}) (%)", share, "< 5", share < 5,
            f"{per_replica[str(mock)]:.0f} of {window_total:.0f} requests the replicas received from "
            f"{fault_t + 10:.1f} s to the end ({served})")
    retry_pct = 100 * retries / summary["requests"] if summary["requests"] else float("nan")
    bar("retries / requests (%)", retry_pct, "<= 10", retry_pct <= 10,
        f"{retries:.0f} retries, {summary['requests']} requests; {served}; injected 500s (whole run) "
        f"{result.proxies.get('err500', {}).get('errors_injected', '-')}")
    procs.stop(gateway)


# -- 3. gateway restart on the same port under 70 % load
async def scenario_restart(options: BenchOptions, procs: Processes, mocks: list[int], log_dir: Path) -> None:
    rate = 0.7 * CAPACITY_RPS
    print(f"\n[3] gateway restart: gateway A (reuse_port, shutdown_delay_s 1) under {rate:g}/s Poisson streaming "
          f"(70 % of {CAPACITY_RPS:g}/s); at 6 s gateway B starts on the same port, SIGTERM to A once B's /ready "
          f"is 200; 20 s of load")
    port = free_port()
    urls = [f"http://127.0.0.1:{p}/v1" for p in mocks]
    server = {"reuse_port": True, "shutdown_delay_s": 1}
    gw_a = procs.start("gw-restart-a", "serve", "--config",
                       gateway_config(options, log_dir, "gw-restart-a", port, urls, **server),
                       ready_url=f"http://127.0.0.1:{port}/ready")
    base = f"http://127.0.0.1:{port}"
    before = {p: mock_requests(p) for p in mocks}
    # a marker: the run's clock is tied to ours by a step at a known time (SIGKILL to a sleeper we started)
    sleeper = subprocess.Popen([PY, "-c", "import time; time.sleep(120)"])
    procs.all.append(sleeper)
    experiment = parse_experiment(yaml.safe_dump({
        "name": "bench-gateway-restart", "duration_s": 20, "tail_s": 0,
        "load": load_spec(base, rate, seed=2),
        "targets": {"marker": [{"pid": sleeper.pid}]},
        "steps": [{"at_s": 1.0, "kill": {"target": "marker"}}]}))
    clock: dict[str, float] = {}

    def on_event(event) -> None:
        if event.action == "kill" and "t0" not in clock:
            clock["t0"] = time.perf_counter() - event.t_s - event.measured.get("apply_s", 0.0)

    info: dict[str, object] = {}

    async def restart() -> None:
        while "t0" not in clock:
            await asyncio.sleep(0.05)
        await asyncio.sleep(max(0.0, clock["t0"] + 6.0 - time.perf_counter()))
        info["b_start"] = time.perf_counter() - clock["t0"]
        gw_b = await asyncio.to_thread(procs.start, "gw-restart-b", "serve", "--config",
                                       gateway_config(options, log_dir, "gw-restart-b", port, urls, **server))
        info["b"] = gw_b
        # A and B share the port: B is ready once it holds a listening socket on it and /ready answers 200
        # on 20 fresh connections in a row (the kernel spreads them over both listeners; a 503 is B's)
        deadline = time.monotonic() + 30
        streak = 0
        while time.monotonic() < deadline and gw_b.poll() is None and streak < 20:
            if not listens_on(gw_b.pid, port):
                await asyncio.sleep(0.1)
                continue
            streak = streak + 1 if await asyncio.to_thread(http_status, f"{base}/ready") == 200 else 0
            await asyncio.sleep(0.02)
        info["b_ready"] = time.perf_counter() - clock["t0"]
        gw_a.send_signal(signal.SIGTERM)
        info["sigterm"] = time.perf_counter() - clock["t0"]
        info["a_rc"] = await asyncio.to_thread(gw_a.wait, 30)
        info["a_exit"] = time.perf_counter() - clock["t0"]

    task = asyncio.ensure_future(restart())
    result = await run_experiment(experiment, log_dir=str(log_dir), on_event=on_event)
    await task
    report = build_report(result)
    summary = report["summary"]
    t_sig, t_b = float(info["sigterm"]), float(info["b_start"])
    pts = points(result)
    from_b = [(s, e, r) for s, e, r in pts if (e if e is not None else s) >= t_b]
    failed_from_b = [r for _s, _e, r in from_b if not r.ok]
    in_flight = [r for s, e, r in pts if s <= t_sig and (e is None or e >= t_sig)]
    in_flight_ok = sum(1 for r in in_flight if r.ok)
    after_counts = {p: mock_requests(p) for p in mocks}
    b_served = total(scrape(f"{base}/metrics"), "tidegate_requests_total")
    mean_e2e = summary["e2e_p50_s"] or 0
    print(f"  B started {t_b:.2f} s, its /ready 200 at {float(info['b_ready']):.2f} s; SIGTERM to A at {t_sig:.2f} s; "
          f"A exited rc {info['a_rc']} at {float(info['a_exit']):.2f} s")
    print(f"  all: {outcome_line(summary)}")
    replica_load = "replica load: " + "; ".join(f"{p}: {after_counts[p] - before[p]:.0f} req" for p in mocks)
    served = (f"served {summary['ok']} of {summary['requests']} (gateway B answered {b_served:.0f}, "
              f"A the rest); e2e p50 {mean_e2e:.3f} s")
    kinds = defaultdict(int)
    for r in failed_from_b:
        kinds[classify(r)] += 1
    bar("failed/refused from B's start to the end", len(failed_from_b), "0", not failed_from_b,
        f"{served}; {dict(kinds) or 'none'}; {replica_load}")
    bar("in flight at SIGTERM that finished (%)", 100.0 * in_flight_ok / len(in_flight) if in_flight else 100.0,
        "100", in_flight_ok == len(in_flight), f"{in_flight_ok} of {len(in_flight)} finished ok; {served}")
    gw_b = info.get("b")
    if isinstance(gw_b, subprocess.Popen):
        procs.stop(gw_b)
