"""The embedded scenario of `bench/chaos.py`: a pool of two serving `tidegate engine` workers under
load at 70 % of what they were measured to serve (measured in the first arm, the same load in every
arm); one is SIGKILLed at 5 s and its supervisor restarts it. Arms without a spare (`spare: 0`, two
workers) and with one (`spare: 1`, a third worker loaded out of traffic), in pairs run ABBA. Prints
the time the pool had fewer than two workers taking traffic after the kill, the median end-to-end
time (and by send window), the success % and what was served, the capacity the load was sized
from, and each worker's CPU and its threads' nice values while the killed worker's replacement
loaded.

Bars: less time under two workers with the spare than without; and a smaller slowdown from the
kill with the spare: each arm's median e2e time of the requests sent from the kill until the worker
restarted without a spare served again, over the same arm's median before the kill. The two arms
are two runs on a shared machine whose speed moved between them (the same two workers measured
2.7-7.1/s): a ratio within each run cancels that speed, where the whole runs' medians (the former
bar, still printed) compared it."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from pathlib import Path

import yaml
from chaos_cpu import WorkerCpu
from chaos_kit import BenchOptions, Processes, bar, free_port, outcome_line, outstanding_by_replica, points

from tidegate.chaos.experiment import parse_experiment
from tidegate.chaos.report import build_report
from tidegate.chaos.runner import ChaosResult, run_experiment

MODEL = "tiny-random-llama"
SERVING = 2
WORKER_SLOTS = 2
MAX_TOKENS = 16
KILL_AT_S, DURATION_S = 5.0, 25.0
REFILL_WAIT_S = 60.0  # after the load, how long the killed worker's replacement is waited for


def _embedded_config(options: BenchOptions, log_dir: Path, name: str, port: int, spare: int) -> str:
    path = log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "server": {"port": port, "access_log": False},
        "health": {"interval_s": 0.5, "cooldown_s": 5},
        "overload_control": options.overload_control,
        "pools": [{"name": MODEL, "spare": spare,
                   "backends": [{"type": "embedded", "model": MODEL, "count": SERVING + spare, "threads": 1,
                                 "slot_limit": WORKER_SLOTS}]}]}))
    return str(path)


def worker_kill_experiment(name: str, base: str, rate: float, duration_s: float, *, seed: int, interval_s: float,
                           victim: str, kill_at_s: float, kill: dict):
    """A chaos experiment: streaming chat load on the gateway at `base`, and at `kill_at_s` the `kill` step
    on the embedded worker at `victim` (host:port) (shared with bench/chaos_embedded_kill.py)."""
    return parse_experiment(yaml.safe_dump({
        "name": name, "duration_s": duration_s, "tail_s": 2,
        "load": {"url": base, "model": MODEL, "endpoint": "chat", "stream": True, "arrival": "poisson",
                 "rate": round(rate, 2), "prompt_tokens": "const:32", "max_tokens": f"const:{MAX_TOKENS}",
                 "ignore_eos": True,  # answers of the asked length, not cut short by a random EOS
                 "timeout_s": 30, "seed": seed},
        "gateway": {"metrics_url": f"{base}/metrics", "interval_s": interval_s},
        "targets": {"worker": [{"port": int(victim.rpartition(":")[2]), "address": victim}]},
        "steps": [{"at_s": kill_at_s, "kill": kill}]}))


def _replicas(base: str) -> list[dict]:
    with urllib.request.urlopen(f"{base}/status.json", timeout=10) as response:
        return json.loads(response.read())["pools"][0]["replicas"]


def _wait_health(base: str, wanted: list[str], timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while [r["health"] for r in _replicas(base)] != wanted:
        if time.monotonic() > deadline:
            raise RuntimeError(f"replicas not {wanted}: {_replicas(base)}")
        time.sleep(0.2)


def _measure_capacity_rps(base: str, seconds: float = 4.0) -> float:
    """Answers per second with every slot of the serving workers kept busy (closed loop)."""
    done = [0]
    until = time.monotonic() + seconds
    body = json.dumps({"model": MODEL, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                       "messages": [{"role": "user", "content": "tell me a story"}]}).encode()

    def client() -> None:
        while time.monotonic() < until:
            request = urllib.request.Request(f"{base}/v1/chat/completions", body,
                                             {"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                response.read()
            done[0] += 1

    threads = [threading.Thread(target=client) for _ in range(SERVING * WORKER_SLOTS)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return done[0] / (time.monotonic() - started)


def _p50_by_window(result: ChaosResult, edges_s: tuple[float, ...]) -> str:
    """Median end-to-end time of the requests sent in each window between `edges_s` (where the
    time goes: before the kill, while the pool is short, after)."""
    parts = []
    for start, end in zip(edges_s, edges_s[1:]):
        times = sorted(record.e2e_s for sent, _end, record in points(result)
                       if start <= sent < end and record.ok and record.e2e_s is not None)
        median = f"{times[len(times) // 2]:.3f} s" if times else "-"
        parts.append(f"{start:g}-{end:g} s: {median} ({len(times)} ok)")
    return "e2e p50 by send time: " + "; ".join(parts)


def _time_short_s(result: ChaosResult, kill_t_s: float) -> float:
    """Seconds after the kill with fewer than SERVING replicas taking traffic (the gateway's gauge)."""
    by_time: dict[float, int] = {}
    for sample in result.samples:
        if sample.metric == "tidegate_replica_healthy" and sample.t_s >= kill_t_s:
            by_time[sample.t_s] = by_time.get(sample.t_s, 0) + int(sample.value)
    times = sorted(by_time)
    return sum((later - earlier for earlier, later in zip(times, times[1:]) if by_time[earlier] < SERVING), 0.0)


def _print_cpu(cpu: WorkerCpu, spare: int, victim_port: int, load_ended_s: float) -> dict:
    """Each worker's CPU (fraction of a core, its threads' nice values) before the kill and while the killed
    worker's replacement loaded (from the kill until it was a standby, or serving when there is no
    spare): whether the load took the serving engines' CPU."""
    killed = cpu.killed_at(victim_port)
    if killed is None or not cpu.samples:
        print(f"  spare {spare}: no per-worker CPU samples (not Linux, or the kill was not seen)")
        return {}
    loaded = cpu.ready_at(victim_port, killed, ("standby",) if spare else ("healthy",))
    end = min(loaded if loaded is not None else cpu.samples[-1].t_s, load_ended_s)  # CPU under load only
    ports = sorted({s.port for s in cpu.samples})

    def serving_ports(start: float, stop: float) -> set[int]:  # by health: an idle spare is not one
        return {port for t, port, health in cpu.health if start <= t < stop and health == "healthy"}

    def window(start: float, stop: float) -> tuple[str, float, float]:
        parts, serving, refill = [], [], 0.0
        for port in ports:
            busy, nices = cpu.busy(port, start, stop)
            role = "refill" if port == victim_port and start >= killed else f"{port}"
            parts.append(f"{role} {busy:.2f} (nice {','.join(map(str, sorted(nices))) or '-'})")
            if port == victim_port and start >= killed:
                refill = busy
            elif port in serving_ports(start, stop):
                serving.append(busy)
        return "; ".join(parts), (sum(serving) / len(serving) if serving else 0.0), refill

    before, before_busy, _ = window(cpu.samples[0].t_s + 1.0, killed)
    during, during_busy, refill_busy = window(killed, end)
    if spare:  # the promoted spare must serve at the gateway's priority from the kill on, every thread
        standby = {port for t, port, health in cpu.health if t < killed and health == "standby"}
        after = [s for s in cpu.samples if s.port in standby and s.t_s >= killed]
        restored = next((s.t_s for s in after if s.nices == {0}), None)
        print(f"  spare {spare}: the promoted spare's threads' nice values at the first sample after the kill "
              f"(+{after[0].t_s - killed:.2f} s): {sorted(after[0].nices)}, all at 0 from "
              f"+{(restored if restored is not None else float('nan')) - killed:.2f} s; over the window: "
              f"{sorted({n for s in after if s.t_s <= end for n in s.nices})}" if after else
              f"  spare {spare}: no sample of the promoted spare after the kill")
    refill_s = loaded - killed if loaded is not None else float("nan")
    under_load = "under load" if loaded is not None and loaded <= load_ended_s else \
        f"the load ended {load_ended_s - killed:.1f} s after the kill"
    print(f"  spare {spare}: CPU per worker (of a core) before the kill: {before}")
    print(f"  spare {spare}: the replacement loaded {refill_s:.1f} s after the kill ({under_load}); CPU per worker "
          f"from the kill to then (under load): {during}; serving engines' mean busy {before_busy:.2f} before -> "
          f"{during_busy:.2f} during")
    return {"refill_s": refill_s, "busy_before": before_busy, "busy_during": during_busy, "refill_busy": refill_busy}


def _arm_order(pairs: int) -> list[int]:
    """The arms' spare counts, run in pairs ABBA (0,1, 1,0, 0,1, ...): a machine that slows or speeds
    up through the session weighs on both arms alike."""
    return [arm for pair in range(pairs) for arm in ((0, 1) if pair % 2 == 0 else (1, 0))]


async def _run_arm(options: BenchOptions, procs: Processes, log_dir: Path, spare: int, rate: float | None,
                   duration_s: float = DURATION_S, load_fraction: float = 0.7) -> dict:
    """One arm: a gateway with `spare` spares, its capacity measured, the load (at `rate`, or
    `load_fraction` of this measure when None) for `duration_s`, the kill; what it printed and its
    result for the pair's bars."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    name = f"gw-embedded-spare{spare}-{free_port()}"
    gateway = procs.start(name, "serve", "--config", _embedded_config(options, log_dir, name, port, spare),
                          ready_url=f"{base}/ready")
    try:
        _wait_health(base, ["healthy"] * SERVING + ["standby"] * spare)
        capacity_rps = _measure_capacity_rps(base)
        rate = rate if rate is not None else load_fraction * capacity_rps
        victim = _replicas(base)[0]["replica"].rpartition("@")[2]
        experiment = worker_kill_experiment(f"bench-embedded-spare{spare}", base, rate, duration_s, seed=4,
                                            interval_s=0.1, victim=victim, kill_at_s=KILL_AT_S,
                                            kill={"target": "worker"})
        victim_port = int(victim.rpartition(":")[2])
        with WorkerCpu(gateway.pid, base) as cpu:
            result = await run_experiment(experiment, log_dir=str(log_dir))
            load_ended_s = time.monotonic()
            # the replacement's load time, which may run past the load: followed (bounded) without it
            refilled = ("standby",) if spare else ("healthy",)
            while (time.monotonic() < load_ended_s + REFILL_WAIT_S
                   and cpu.ready_at(victim_port, cpu.killed_at(victim_port) or 0.0, refilled) is None):
                await asyncio.sleep(0.5)
        summary = build_report(result)["summary"]
        kill = next(e for e in result.timeline if e.action == "kill")
        short_s = _time_short_s(result, kill.t_s)
        outcome = {"short_s": short_s, "success_pct": summary["success_pct"], "served": summary["ok"],
                   "failed": summary["requests"] - summary["ok"], "e2e_p50_s": summary["e2e_p50_s"] or 0.0,
                   "e2e_p99_s": summary["e2e_p99_s"] or 0.0, "load_rps": rate, "capacity_rps": capacity_rps}
        print(f"  spare {spare}: measured capacity {capacity_rps:.1f}/s with {SERVING} workers, load {rate:.1f}/s "
              f"({load_fraction:.0%} of the first arm's); killed {victim} at {kill.t_s:.2f} s ({kill.outcome.value}); "
              f"fewer than {SERVING} workers taking traffic for {short_s:.2f} s after the kill")
        print(f"  spare {spare}: {outcome_line(summary)}")
        if rate > 0.9 * capacity_rps:  # the ratio cancels the machine's speed, not a queue that never drains
            print(f"  spare {spare}: WARNING the load is {rate / capacity_rps:.0%} of this arm's own measured "
                  f"capacity: the machine was slower in this arm, and its slowdown reads an overload, not the kill")
        windows = (0.0, kill.t_s, kill.t_s + 5, kill.t_s + 10, duration_s + 1)
        print(f"  spare {spare}: {_p50_by_window(result, windows)}")
        outcome.update(_print_cpu(cpu, spare, victim_port, load_ended_s))
        held = outstanding_by_replica(result, kill.t_s, kill.t_s + 10)
        print(f"  spare {spare}: mean requests held by each replica in the 10 s after the kill "
              f"(of {WORKER_SLOTS}): " + ", ".join(f"{address} {value:.2f}" for address, value in sorted(held.items())))
        return {"spare": spare, "result": result, "kill_t_s": kill.t_s, "outcome": outcome}
    finally:
        procs.stop(gateway)


def _slowdown(arm: dict, window_s: float) -> tuple[float, str]:
    """The arm's median e2e time of the requests sent from the kill to `window_s` after it, over its
    own median of those sent before the kill: how much the kill slowed this run's requests, the
    machine's speed in this run cancelled. A request that failed counts as slower than any served."""
    kill_t_s = arm["kill_t_s"]
    before, _ = _window_p50(arm["result"], 0.0, kill_t_s)
    after, failed = _window_p50(arm["result"], kill_t_s, kill_t_s + window_s)
    ratio = after / before if before > 0 else float("inf")
    return ratio, f"{after:.3f} s / {before:.3f} s before the kill" + (f", {failed} failed" if failed else "")


def _window_p50(result: ChaosResult, start_s: float, end_s: float) -> tuple[float, int]:
    """The median e2e time of every request sent in [start_s, end_s), failed ones as infinitely slow;
    and how many failed."""
    times = sorted(record.e2e_s if record.ok and record.e2e_s is not None else float("inf")
                   for sent, _end, record in points(result) if start_s <= sent < end_s)
    return (times[len(times) // 2] if times else float("nan")), sum(t == float("inf") for t in times)


async def scenario_embedded(options: BenchOptions, procs: Processes, log_dir: Path) -> list[tuple[dict, dict]]:
    pairs = options.embedded_pairs
    print(f"\n[4] embedded: {SERVING} `{MODEL}` workers serving (slot_limit {WORKER_SLOTS}), one SIGKILLed at "
          f"{KILL_AT_S:g} s and restarted by the supervisor; without a spare and with `spare: 1`, "
          f"{pairs} pair(s) run ABBA")
    # one load for every arm, sized from the first arm's measure: sized from each arm's own, a
    # measure 18 % higher (11.7/s against 9.9/s, the same two workers) sent the spare's arm 8.2/s
    # against 6.9/s, and its median paid for the extra load, not for the spare
    rate: float | None = None
    arms: list[dict] = []
    for spare in _arm_order(pairs):
        arms.append(await _run_arm(options, procs, log_dir, spare, rate))
        rate = arms[0]["outcome"]["load_rps"]
    by_pair = [(next(a for a in arms[2 * i:2 * i + 2] if a["spare"] == 0),
                next(a for a in arms[2 * i:2 * i + 2] if a["spare"] == 1)) for i in range(pairs)]
    for index, (no_spare, spare) in enumerate(by_pair):
        # the window the spare is for: from the kill until the worker restarted without a spare served
        window_s = max(no_spare["outcome"]["short_s"], 5.0)
        for arm in (no_spare, spare):
            arm["outcome"]["slowdown"], arm["slowdown_text"] = _slowdown(arm, window_s)
        print(f"  pair {index + 1}: e2e p50 of the requests sent in the {window_s:.1f} s after the kill (the "
              f"restart's time without a spare) over the same arm's before the kill: without a spare "
              f"{no_spare['outcome']['slowdown']:.2f}x ({no_spare['slowdown_text']}), with one "
              f"{spare['outcome']['slowdown']:.2f}x ({spare['slowdown_text']})")
    worst_short = max(spare["outcome"]["short_s"] for _no, spare in by_pair)
    least_short = min(no["outcome"]["short_s"] for no, _spare in by_pair)
    bar("time under 2 workers, with a spare (s)", worst_short, f"< {least_short:.2f}", worst_short < least_short,
        "the most of any spare arm against the least of any arm without one")
    # the spare's gain is capacity kept while the dead worker restarts; each arm's slowdown is its own
    # ratio (the machine's speed, which differed between runs by up to 3x, cancels), and the bar is on
    # the median over pairs of the spare's slowdown over the no-spare arm's of the same pair
    relative = sorted(spare["outcome"]["slowdown"] / no["outcome"]["slowdown"] for no, spare in by_pair)
    median = relative[len(relative) // 2] if len(relative) % 2 else sum(relative[len(relative) // 2 - 1:
                                                                                 len(relative) // 2 + 1]) / 2
    bar("kill's slowdown, spare / no spare (x)", median, "< 1", median < 1.0,
        "per pair: " + ", ".join(f"{value:.2f}" for value in relative))
    # the former bar's figure, printed: whole runs' medians, which two runs' machine speeds decide
    for index, (no_spare, spare) in enumerate(by_pair):
        print(f"  pair {index + 1} (not a bar): e2e p50 of all requests with a spare "
              f"{spare['outcome']['e2e_p50_s']:.3f} s, without {no_spare['outcome']['e2e_p50_s']:.3f} s "
              f"(ratio {spare['outcome']['e2e_p50_s'] / max(no_spare['outcome']['e2e_p50_s'], 1e-9):.2f}); "
              f"success with {spare['outcome']['success_pct']:.3f} % ({spare['outcome']['failed']} failed, "
              f"{spare['outcome']['served']} served), without {no_spare['outcome']['success_pct']:.3f} % "
              f"({no_spare['outcome']['failed']} failed, {no_spare['outcome']['served']} served)")
    for arm in arms:  # one line per arm, for comparing runs
        print(f"  row spare={arm['spare']} " + " ".join(
            f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}"
            for key, value in arm["outcome"].items()))
    return [(no["outcome"], spare["outcome"]) for no, spare in by_pair]
