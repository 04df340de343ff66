"""Issue 19's Batch API bars, live: `tidegate serve` over two modelled engines and a real redis-server.

Replicas are `bench/overload_knee_mock.py` engines (iteration-level batching; a step takes `--step-ms`
up to `--knee` running sequences and grows beyond), each behind a gateway `slot_limit` equal to its
knee, so the slots are the capacity. Figures printed:

  capacity     completed req/s of a closed loop that keeps every slot busy, measured first
  protection   interactive (tier standard, streamed) Poisson traffic at 0.5x capacity: windows alone,
               then windows with the same arrivals (same seeds) beside a 1,000-request batch (tier
               batch): interactive P99 TTFT with the batch vs alone; bar: < +10 %, and the batch
               completes. Printed beside: how long the batch took, the requests served per second
               and the utilisation of the replicas' capacity, and what preemption cost the batch
               (`policy.pool` rule 9: interactive requests stop batch ones for their slots; the
               gateway's preemption counters, and the engines' runs against the batch's results)
  kill         a batch running on a gateway that is SIGKILLed mid-way and started again: every
               custom_id has exactly one line in the output file (zero lost, zero duplicated); the
               requests the engines ran more than once are printed (what the idempotent results absorbed)
  redis        the same with redis-server (appendonly yes) SIGKILLed mid-batch and started again on
               its data directory

Run: flock /tmp/tidegate-bench.lock python bench/batch_api.py [--phase-s 20 --windows 3] [--batch 1000] [--crash-batch 600]
     [--max-in-flight 8 --share-memory-s 10 | 0] [--no-preemption] [--skip-crash]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
import yaml

from gateway_overhead import free_port, wait_ok  # bench/ is the script's directory

HERE = Path(__file__).resolve().parent
INTERACTIVE_KEY, BATCH_KEY = "sk-interactive", "sk-batch-owner"
REPLICAS = 2
MAX_TTFT_RAISE = 0.10
HEADROOM_SHARE = 1 / 3  # limits.headroom_share's default: a replica's slots only better tiers take
FINAL = ("completed", "failed", "expired", "cancelled")


class Processes:
    """What the bench started, stopped by PID at the end."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.started: list[subprocess.Popen] = []

    def start(self, name: str, argv: list[str], ready_url: str | None = None) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")
        env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.started.append(process)
        if ready_url is not None:
            wait_ok(ready_url, timeout_s=60)
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


class Redis:
    def __init__(self, processes: Processes) -> None:
        self.processes = processes
        self.port = free_port()
        self.dir = processes.workdir / "redis"
        self.dir.mkdir()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            sys.exit("redis-server is not installed")
        self.process = self.processes.start("redis", [binary, "--port", str(self.port), "--bind", "127.0.0.1",
                                                      "--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
                                                      "--dir", str(self.dir), "--protected-mode", "no"])
        import redis

        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                return
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()


def gateway_config(port: int, upstreams: list[str], redis_url: str, knee: int, max_in_flight: int,
                   share_memory_s: float, preemptible: bool) -> dict:
    return {
        "server": {"port": port, "access_log": False},
        "pools": [{"name": "knee", "backends": [{"type": "upstream", "url": url, "slot_limit": knee}
                                                for url in upstreams]}],
        "tenants": {"app": {"api_keys": [INTERACTIVE_KEY], "tier": "standard"},
                    "jobs": {"api_keys": [BATCH_KEY]}},
        "batch": {"redis_url": redis_url, "max_in_flight": max_in_flight, "claim_idle_s": 3.0,
                  "sweep_interval_s": 0.5, "share_memory_s": share_memory_s, "preemptible": preemptible},
    }


def start_gateway(processes: Processes, config: dict, name: str) -> subprocess.Popen:
    path = processes.workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    port = config["server"]["port"]
    return processes.start(name, [sys.executable, "-m", "tidegate", "serve", "--config", str(path)],
                           ready_url=f"http://127.0.0.1:{port}/ready")


# ---- interactive traffic ---------------------------------------------------------------------------

async def streamed(session: aiohttp.ClientSession, base: str, tokens: int) -> tuple[bool, float]:
    """(ok, TTFT s) of one streamed chat request."""
    body = {"model": "knee", "stream": True, "max_tokens": tokens, "messages": [{"role": "user", "content": "hi"}]}
    started = time.perf_counter()
    ttft = float("nan")
    try:
        async with session.post(f"{base}/v1/chat/completions", json=body,
                                headers={"authorization": f"Bearer {INTERACTIVE_KEY}"}) as response:
            if response.status != 200:
                await response.read()
                return False, ttft
            async for line in response.content:
                if ttft != ttft and b'"content"' in line:
                    ttft = time.perf_counter() - started
            return ttft == ttft, ttft
    except aiohttp.ClientError:
        return False, ttft


async def closed_loop(base: str, clients: int, duration_s: float, tokens: int) -> float:
    """Completed requests per second with `clients` always waiting: the capacity."""
    done = 0
    deadline = time.perf_counter() + duration_s

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            ok, _ = await streamed(session, base, tokens)
            done += ok

    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return done / (time.perf_counter() - started)


async def open_loop(base: str, rate: float, until: asyncio.Event | float, tokens: int, seed: int,
                    max_s: float) -> list[tuple[bool, float]]:
    """Poisson arrivals at `rate` until the deadline (seconds) or the event, at most `max_s`."""
    rng = random.Random(seed)
    results: list[tuple[bool, float]] = []
    tasks: list[asyncio.Task] = []
    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one() -> None:
            results.append(await streamed(session, base, tokens))

        next_s = started
        while True:
            elapsed = time.perf_counter() - started
            if elapsed >= max_s or (isinstance(until, float) and elapsed >= until) or \
                    (isinstance(until, asyncio.Event) and until.is_set()):
                break
            next_s += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, next_s - time.perf_counter()))
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    return results


def p99(results: list[tuple[bool, float]]) -> float:
    return float(np.percentile([ttft for ok, ttft in results if ok], 99))


# ---- the Batch API ---------------------------------------------------------------------------------

def batch_file(count: int, tokens: int) -> bytes:
    return b"".join(json.dumps({"custom_id": f"job-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "knee", "max_tokens": tokens,
                                         "messages": [{"role": "user", "content": f"item {i}"}]}}).encode() + b"\n"
                    for i in range(count))


async def api(session: aiohttp.ClientSession, method: str, url: str, **kwargs) -> dict | bytes:
    async with session.request(method, url, headers={"authorization": f"Bearer {BATCH_KEY}"}, **kwargs) as response:
        data = await response.read()
        if response.status != 200:
            raise RuntimeError(f"{method} {url}: {response.status} {data[:300]!r}")
        return data if url.endswith("/content") else json.loads(data)


async def submit_batch(base: str, count: int, tokens: int) -> str:
    async with aiohttp.ClientSession() as session:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", batch_file(count, tokens), filename="jobs.jsonl", content_type="application/jsonl")
        uploaded = await api(session, "POST", f"{base}/v1/files", data=form)
        batch = await api(session, "POST", f"{base}/v1/batches",
                          json={"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions",
                                "completion_window": "24h"})
        return batch["id"]


async def batch_state(base: str, batch_id: str) -> dict | None:
    """The batch, or None while the gateway or Redis is away."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            return await api(session, "GET", f"{base}/v1/batches/{batch_id}")
    except (aiohttp.ClientError, RuntimeError, asyncio.TimeoutError):
        return None


async def wait_batch(base: str, batch_id: str, timeout_s: float, done_at_least: int | None = None) -> dict:
    """Polls until the batch is final (or has `done_at_least` results)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = await batch_state(base, batch_id)
        if state is not None:
            counts = state["request_counts"]
            if state["status"] in FINAL or (done_at_least is not None
                                            and counts["completed"] + counts["failed"] >= done_at_least):
                return state
        await asyncio.sleep(0.2)
    raise TimeoutError(f"batch {batch_id} not done in {timeout_s}s: {state}")


async def result_check(base: str, state: dict, count: int) -> tuple[bool, int, int, int]:
    """(exactly once each, lines, distinct custom_ids, missing)."""
    lines: list[dict] = []
    async with aiohttp.ClientSession() as session:
        for field in ("output_file_id", "error_file_id"):
            if state.get(field):
                content = await api(session, "GET", f"{base}/v1/files/{state[field]}/content")
                lines += [json.loads(line) for line in content.splitlines() if line.strip()]
    ids = [line["custom_id"] for line in lines]
    wanted = {f"job-{i}" for i in range(count)}
    missing = len(wanted - set(ids))
    return len(ids) == len(set(ids)) == count and not missing, len(ids), len(set(ids)), missing


def preemption_counters(base: str) -> tuple[float, float]:
    """(batch requests preempted, seconds they had run) from the gateway's metrics."""
    import urllib.request

    request = urllib.request.Request(f"{base}/metrics", headers={"authorization": f"Bearer {INTERACTIVE_KEY}"})
    counts = [0.0, 0.0]
    with urllib.request.urlopen(request, timeout=5) as response:
        for line in response.read().decode().splitlines():
            for index, name in enumerate(("tidegate_overload_preemptions_total", "tidegate_overload_preempted_seconds_total")):
                if line.startswith(name + "{"):
                    counts[index] += float(line.split()[-1])
    return counts[0], counts[1]


def engine_completed(ports: list[int]) -> int:
    import urllib.request

    total = 0
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("knee_completed"):
                    total += int(line.split()[1])
    return total


# ---- the bars --------------------------------------------------------------------------------------

async def protection_bar(base: str, capacity: float, args: argparse.Namespace, upstream_ports: list[int]) -> bool:
    """Common random numbers: the interactive arrivals of each measured window beside the batch are
    the same (same seeds) as those of a window alone, so the difference is the batch's, not the
    arrivals' luck (two alone phases of different seeds differed 2x in P99 in trial runs)."""
    rate = 0.5 * capacity
    seeds = range(1, args.windows + 1)
    print(f"\n[protection] interactive at 0.5x capacity = {rate:.1f} req/s, streamed, tier standard; "
          f"{args.windows} windows of {args.phase_s:.0f} s alone, then the same arrivals beside the batch")
    alone = [await open_loop(base, rate, float(args.phase_s), args.tokens, seed=seed, max_s=args.phase_s)
             for seed in seeds]
    preempted_before, preempted_s_before = preemption_counters(base)
    engines_before = engine_completed(upstream_ports)
    batch_id = await submit_batch(base, args.batch, args.tokens)
    started = time.perf_counter()
    beside = [await open_loop(base, rate, float(args.phase_s), args.tokens, seed=seed, max_s=args.phase_s)
              for seed in seeds]
    measured_s = time.perf_counter() - started
    overlap = await batch_state(base, batch_id)
    finished = asyncio.Event()

    async def watch() -> dict:
        state = await wait_batch(base, batch_id, args.max_batch_s)
        finished.set()
        return state

    watcher = asyncio.create_task(watch())
    rest = await open_loop(base, rate, finished, args.tokens, seed=99, max_s=args.max_batch_s)  # until it is done
    state = await watcher
    batch_s = time.perf_counter() - started
    flat_alone, flat_beside = [r for w in alone for r in w], [r for w in beside for r in w]
    ok_alone, ok_beside = sum(ok for ok, _ in flat_alone), sum(ok for ok, _ in flat_beside)
    p99_alone, p99_beside = p99(flat_alone), p99(flat_beside)
    raise_ = p99_beside / p99_alone - 1
    counts = state["request_counts"]
    window_s = args.windows * args.phase_s
    served_alone = ok_alone / window_s
    interactive_s = (ok_beside + sum(ok for ok, _ in rest)) / batch_s
    served_beside = interactive_s + counts["completed"] / batch_s
    still_running = overlap is not None and overlap["status"] == "in_progress"
    print(f"  alone:  {len(flat_alone)} requests ({len(flat_alone) - ok_alone} failed), P99 TTFT "
          f"{p99_alone * 1000:.1f} ms (windows: {', '.join(f'{p99(w) * 1000:.0f}' for w in alone)} ms), "
          f"served {served_alone:.1f} req/s, utilisation {served_alone / capacity:.0%}")
    print(f"  beside: {len(flat_beside)} requests ({len(flat_beside) - ok_beside} failed), P99 TTFT "
          f"{p99_beside * 1000:.1f} ms (windows: {', '.join(f'{p99(w) * 1000:.0f}' for w in beside)} ms); the batch "
          f"{'was still running after' if still_running else 'had ENDED before the end of'} the {measured_s:.0f} s measured")
    print(f"  batch of {args.batch}: {state['status']} in {batch_s:.1f} s ({counts['completed']} completed, "
          f"{counts['failed']} failed, {counts['completed'] / batch_s:.1f} req/s); served {served_beside:.1f} req/s "
          f"(interactive {interactive_s:.1f} + batch {counts['completed'] / batch_s:.1f}), "
          f"utilisation {served_beside / capacity:.0%}")
    preempted, preempted_s = (after - before for after, before in zip(preemption_counters(base),
                                                                       (preempted_before, preempted_s_before)))
    interactive_done = ok_beside + sum(ok for ok, _ in rest)
    # the knee engines count answers they completed; a preempted (cut off) run is not one of them
    engines_ran = engine_completed(upstream_ports) - engines_before
    print(f"  preemption {'on' if args.preemption else 'off'}: {preempted:.0f} batch requests preempted "
          f"({preempted / max(1, args.batch):.1%} of the batch, {preempted / batch_s:.1f}/s), {preempted_s:.1f} s of "
          f"their runs thrown away ({preempted_s / max(1e-9, preempted):.3f} s each, "
          f"{preempted_s / (args.batch * args.tokens * args.step_ms / 1000):.1%} of the batch's own engine time); "
          f"engines completed {engines_ran} answers for {interactive_done} interactive + {counts['completed']} batch")
    exact, lines, distinct, missing = await result_check(base, state, args.batch)
    passed = (raise_ < MAX_TTFT_RAISE and state["status"] == "completed" and exact and still_running
              and ok_beside == len(flat_beside))
    print(f"  interactive P99 TTFT with the batch vs alone: {raise_:+.1%} (bar < +{MAX_TTFT_RAISE:.0%}); "
          f"batch finished: {state['status']}, {lines} result lines, {distinct} custom_ids, {missing} missing "
          f"-> {'PASS' if passed else 'FAIL'}")
    return passed


async def crash_bar(name: str, processes: Processes, redis: Redis, config: dict, upstream_ports: list[int],
                    args: argparse.Namespace, crash_redis: bool) -> bool:
    base = f"http://127.0.0.1:{config['server']['port']}"
    count = args.crash_batch
    engines_before = engine_completed(upstream_ports)
    batch_id = await submit_batch(base, count, args.tokens)
    started = time.perf_counter()
    mid = await wait_batch(base, batch_id, args.max_batch_s, done_at_least=count * 2 // 5)
    done_before = mid["request_counts"]["completed"]
    if crash_redis:
        redis.kill()
        print(f"\n[{name}] redis-server SIGKILLed with {done_before}/{count} results in; restarted after 2 s")
        await asyncio.sleep(2.0)
        redis.start()
    else:
        gateway = processes.started[-1]
        gateway.kill()
        gateway.wait()
        import redis as redis_client

        held = redis_client.Redis.from_url(redis.url).xpending("tidegate:batch:queue", "workers")["pending"]
        print(f"\n[{name}] gateway SIGKILLed with {done_before}/{count} results in and {held} entries held "
              f"unacknowledged; restarted")
        start_gateway(processes, config, f"gateway-{name}")
    state = await wait_batch(base, batch_id, args.max_batch_s)
    took_s = time.perf_counter() - started
    exact, lines, distinct, missing = await result_check(base, state, count)
    ran = engine_completed(upstream_ports) - engines_before
    passed = exact and state["status"] == "completed"
    print(f"  batch {state['status']} in {took_s:.1f} s ({count / took_s:.1f} req/s); counts {state['request_counts']}; "
          f"engines ran {ran} requests for {count} custom_ids ({max(0, ran - count)} more than once or cut off)")
    print(f"  result lines {lines}, distinct custom_ids {distinct}, lost {missing}, duplicated {lines - distinct} "
          f"-> {'PASS' if passed else 'FAIL'}")
    return passed


async def run(args: argparse.Namespace, processes: Processes) -> int:
    redis = Redis(processes)
    redis.start()
    upstream_ports = [free_port() for _ in range(REPLICAS)]
    for index, port in enumerate(upstream_ports):
        processes.start(f"engine{index}", [sys.executable, str(HERE / "overload_knee_mock.py"), "--port", str(port),
                                           "--knee", str(args.knee), "--step-ms", str(args.step_ms),
                                           "--tokens", str(args.tokens)], ready_url=f"http://127.0.0.1:{port}/health")
    config = gateway_config(free_port(), [f"http://127.0.0.1:{p}/v1" for p in upstream_ports], redis.url, args.knee,
                            args.max_in_flight, args.share_memory_s, args.preemption)
    start_gateway(processes, config, "gateway")
    base = f"http://127.0.0.1:{config['server']['port']}"
    slots = REPLICAS * args.knee
    per_request_s = args.tokens * args.step_ms / 1000
    print(f"replicas: {REPLICAS} x knee mock (knee {args.knee} running, step {args.step_ms:.0f} ms, {args.tokens} tokens "
          f"an answer), slot_limit {args.knee} each: {slots} slots; batch worker max_in_flight {args.max_in_flight}, "
          f"background share {f'over {args.share_memory_s:.0f} s' if args.share_memory_s > 0 else 'off'}, "
          f"preemption {'on' if args.preemption else 'off'}; "
          f"redis-server appendonly yes")
    # the replicas' own capacity: a closed loop straight at the engines, every slot busy (through the
    # gateway a tier gets only its share of the slots, the rest being headroom for better tiers)
    capacity = sum([await closed_loop(f"http://127.0.0.1:{port}", args.knee, args.capacity_s, args.tokens)
                    for port in upstream_ports])
    await closed_loop(base, slots, 3.0, args.tokens)  # warm-up: the controller fits its TTFT line
    print(f"capacity: {capacity:.1f} req/s measured (closed loop of {args.knee} clients at each engine, "
          f"{args.capacity_s:.0f} s); the slots' bound {slots / per_request_s:.1f} req/s at "
          f"{per_request_s * 1000:.0f} ms a request")
    ok = await protection_bar(base, capacity, args, upstream_ports)
    if args.skip_crash:
        return 0 if ok else 1
    # the crash bars run more at once, so that a crash catches many requests mid-way
    gateway = processes.started[-1]
    gateway.terminate()
    gateway.wait()
    config = {**config, "batch": {**config["batch"], "max_in_flight": args.crash_max_in_flight}}
    start_gateway(processes, config, "gateway-crash")
    print(f"\n[crash bars] batch worker max_in_flight {args.crash_max_in_flight}, claim_idle_s "
          f"{config['batch']['claim_idle_s']}")
    ok &= await crash_bar("kill", processes, redis, config, upstream_ports, args, crash_redis=False)
    ok &= await crash_bar("redis", processes, redis, config, upstream_ports, args, crash_redis=True)
    print(f"\n{'PASS' if ok else 'FAIL'}: all bars")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--phase-s", type=float, default=20.0, help="each measured window of interactive traffic")
    parser.add_argument("--windows", type=int, default=3, help="windows alone, and as many beside the batch")
    parser.add_argument("--capacity-s", type=float, default=10.0)
    parser.add_argument("--batch", type=int, default=1000, help="requests in the protection bar's batch")
    parser.add_argument("--crash-batch", type=int, default=600, help="requests in the kill and redis bars' batches")
    parser.add_argument("--max-batch-s", type=float, default=400.0, help="give up on a batch after this long")
    parser.add_argument("--knee", type=int, default=4)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--tokens", type=int, default=10)
    parser.add_argument("--max-in-flight", type=int, default=None,
                        help="the gateway's batch.max_in_flight in the protection bar; default: the replicas' "
                             "headroom slots (what interactive tiers alone never use)")
    parser.add_argument("--crash-max-in-flight", type=int, default=16)
    parser.add_argument("--share-memory-s", type=float, default=0.0,
                        help="batch.share_memory_s: batch holds the level slots less the interactive demand's mean "
                             "over this window (policy.background_share); 0: only max_in_flight bounds it")
    parser.add_argument("--no-preemption", dest="preemption", action="store_false",
                        help="batch.preemptible false: batch requests keep their slots until they end")
    parser.add_argument("--skip-crash", action="store_true", help="the protection bar only")
    args = parser.parse_args()
    if args.max_in_flight is None:
        headroom = min(args.knee - 1, round(args.knee * HEADROOM_SHARE))
        args.max_in_flight = max(1, REPLICAS * headroom)
    processes = Processes(Path(tempfile.mkdtemp(prefix="tidegate-batch-bench-")))
    try:
        return asyncio.run(run(args, processes))
    finally:
        processes.stop_all()
        print(f"logs: {processes.workdir}")


if __name__ == "__main__":
    sys.exit(main())
