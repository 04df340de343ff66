"""Issue 19's active-active bar, live: 3 gateways over the same 2 modelled replicas at 2x capacity.

Replicas are `bench/overload_knee_mock.py` engines: a batch of `--knee` sequences runs at once (more
wait inside the engine, where no gateway steers them), each gateway's `slot_limit` is that batch.
Every gateway is `tidegate serve` with overload control, `shared_state: redis` on a redis-server
the bench starts. Open-loop Poisson traffic (streamed chat, tier standard) at `--load` x the
measured capacity for `--seconds`, spread over the gateways round-robin (or by `--weights`), once per
arm, the same arrivals (same seed) in each:

  1 gateway          the baseline
  3 per_gateway      `shared_state.dispatch: per_gateway`: each gateway fills every replica's batch
  3 split            `dispatch: split` (gateway/shared_dispatch.py): each takes its share
  3 split, weighted  the load balancer sends 6:3:1 of the traffic to the three

Printed per arm: goodput (requests answered with their first token within the tier's 5 s TTFT
target, per second), completed and refused per second, TTFT P50/P99 of the answered, the engines'
batch utilisation (mean running / batch), and the engines' waiting queues (time-mean and peak,
summed over the two engines: requests the gateways sent beyond the batch). Bar: the 3 split arms'
goodput >= 0.9 x one gateway's, and their engines' mean waiting <= 1 request (near zero: a request
arriving mid-step waits for the step's end even in an engine with room).

`--outside K`: K clients at each engine send straight to it (past every gateway) through each arm's
window, a closed loop: a notebook or another service using the engines. The gateways read it off
the engines' gauges and split only the slots it leaves (`policy.slot_split.OutsideLoad`); the
outside clients' completions per second and TTFT P50 are printed beside the arms (1 gateway and 3
split only). Run it on this code and on code without the subtraction to see what it changes.

`--sim` prints the same arms simulated instead (`tidegate.sim.active_active`, the policy the
gateways run, on modelled engines; chat answers and answers shorter than a heartbeat).

Run: flock <lock> python bench/active_active.py [--seconds 20 --load 2.0 --knee 6 --step-ms 25 --tokens 16] [--sim]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

from batch_api import Processes, Redis, closed_loop, start_gateway, streamed  # bench/ is the script's directory
from gateway_overhead import free_port

HERE = Path(__file__).resolve().parent
REPLICAS = 2
TTFT_TARGET_S = 5.0  # tier standard's default ttft_target_s
MIN_GOODPUT_RATIO = 0.9
MAX_MEAN_WAITING = 1.0


def gateway_config(port: int, upstreams: list[str], redis_url: str, knee: int, dispatch: str, gateways: int) -> dict:
    return {
        "server": {"port": port, "access_log": False},
        "pools": [{"name": "knee", "backends": [{"type": "upstream", "url": url, "slot_limit": knee}
                                                for url in upstreams]}],
        "tenants": {"app": {"api_keys": ["sk-interactive"], "tier": "standard"}},
        "shared_state": {"backend": "redis", "redis_url": redis_url, "dispatch": dispatch,
                         "gateway_count": gateways},
        "batch": {"enabled": False},
    }


def engine_gauges(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {name: float(value) for name, value in (line.split() for line in text.splitlines()
                                                   if line.startswith("knee_"))}


def reset_peaks(port: int) -> None:
    urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/admin/reset_peaks", data=b""),
                           timeout=5).read()


async def drained(ports: list[int], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(g["knee_running"] == 0 and g["knee_waiting"] == 0 for g in map(engine_gauges, ports)):
            return
        await asyncio.sleep(0.2)


async def open_loop(bases: list[str], weights: list[float], rate: float, duration_s: float, tokens: int,
                    seed: int) -> list[tuple[bool, float]]:
    """Poisson arrivals at `rate` for `duration_s`, each sent to a gateway drawn by `weights`."""
    rng = random.Random(seed)
    results: list[tuple[bool, float]] = []
    tasks: list[asyncio.Task] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(base: str) -> None:
            results.append(await streamed(session, base, tokens))

        started = time.perf_counter()
        next_s = started
        while True:
            next_s += rng.expovariate(rate)
            if next_s - started >= duration_s:
                break
            base = rng.choices(bases, weights)[0]
            await asyncio.sleep(max(0.0, next_s - time.perf_counter()))
            tasks.append(asyncio.create_task(one(base)))
        await asyncio.gather(*tasks)
    return results


@dataclass
class ArmResult:
    name: str
    goodput: float
    completed: float
    refused: float
    ttft_p50_s: float
    ttft_p99_s: float
    utilisation: float
    waiting_mean: float
    waiting_peak: float
    running_peak: float
    outside_completed: float = 0.0  # requests/s the outside clients completed
    outside_ttft_p50_s: float = float("nan")


async def arm(name: str, processes: Processes, redis_url: str, upstream_ports: list[int], args: argparse.Namespace,
              gateways: int, dispatch: str, weights: list[float], capacity: float) -> ArmResult:
    upstreams = [f"http://127.0.0.1:{p}/v1" for p in upstream_ports]
    started: list = []
    bases: list[str] = []
    for index in range(gateways):
        config = gateway_config(free_port(), upstreams, redis_url, args.knee, dispatch, gateways)
        started.append(start_gateway(processes, config, f"{name.replace(' ', '-')}-{index}"))
        bases.append(f"http://127.0.0.1:{config['server']['port']}")
    # warm-up: every gateway's controller fits its TTFT line, the split settles
    await asyncio.gather(*(closed_loop(base, args.knee, 3.0, args.tokens) for base in bases))
    await drained(upstream_ports)
    for port in upstream_ports:
        reset_peaks(port)
    outside: list[tuple[bool, float]] = []
    stop_outside = asyncio.Event()

    async def outside_client(session: aiohttp.ClientSession, port: int) -> None:
        while not stop_outside.is_set():
            outside.append(await streamed(session, f"http://127.0.0.1:{port}", args.tokens))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as outside_session:
        clients = [asyncio.create_task(outside_client(outside_session, port))
                   for port in upstream_ports for _ in range(args.outside)]
        if clients:
            await asyncio.sleep(6.0)  # three health checks: the gateways have read the outside load
            outside.clear()
        before = [engine_gauges(port) for port in upstream_ports]
        began = time.perf_counter()
        results = await open_loop(bases, weights, args.load * capacity, args.seconds, args.tokens, args.seed)
        window_s = time.perf_counter() - began
        outside_done = list(outside)
        stop_outside.set()
        await asyncio.gather(*clients)
    after = [engine_gauges(port) for port in upstream_ports]
    for process in started:
        process.terminate()
    for process in started:
        process.wait()
    await drained(upstream_ports)
    ttfts = [ttft for ok, ttft in results if ok]
    good = sum(1 for ok, ttft in results if ok and ttft <= TTFT_TARGET_S)
    running_s = sum(a["knee_running_seconds_total"] - b["knee_running_seconds_total"] for a, b in zip(after, before))
    waiting_s = sum(a["knee_waiting_seconds_total"] - b["knee_waiting_seconds_total"] for a, b in zip(after, before))
    outside_ttfts = [ttft for ok, ttft in outside_done if ok]
    return ArmResult(name, good / window_s, len(ttfts) / window_s, (len(results) - len(ttfts)) / window_s,
                     float(np.percentile(ttfts, 50)) if ttfts else float("nan"),
                     float(np.percentile(ttfts, 99)) if ttfts else float("nan"),
                     running_s / (window_s * REPLICAS * args.knee), waiting_s / window_s,
                     sum(a["knee_waiting_peak"] for a in after), max(a["knee_running_peak"] for a in after),
                     len(outside_ttfts) / window_s,
                     float(np.percentile(outside_ttfts, 50)) if outside_ttfts else float("nan"))


async def run(args: argparse.Namespace, processes: Processes) -> int:
    redis = Redis(processes)
    redis.start()
    upstream_ports = [free_port() for _ in range(REPLICAS)]
    for index, port in enumerate(upstream_ports):
        processes.start(f"engine{index}", [sys.executable, str(HERE / "overload_knee_mock.py"), "--port", str(port),
                                           "--knee", str(args.knee), "--max-running", str(args.knee),
                                           "--step-ms", str(args.step_ms), "--tokens", str(args.tokens)],
                        ready_url=f"http://127.0.0.1:{port}/health")
    capacity = sum([await closed_loop(f"http://127.0.0.1:{port}", args.knee, args.capacity_s, args.tokens)
                    for port in upstream_ports])
    await drained(upstream_ports)
    print(f"replicas: {REPLICAS} x knee mock (batch {args.knee}, step {args.step_ms:.0f} ms, {args.tokens} tokens an "
          f"answer); every gateway's slot_limit {args.knee} a replica; redis-server")
    print(f"capacity: {capacity:.1f} req/s measured (closed loop of {args.knee} clients at each engine); offered "
          f"{args.load:.1f}x = {args.load * capacity:.1f} req/s for {args.seconds:.0f} s per arm, same arrivals")
    arms = [("1 gateway", 1, "split", [1.0]),
            ("3 per_gateway", 3, "per_gateway", [1.0, 1.0, 1.0]),
            ("3 split", 3, "split", [1.0, 1.0, 1.0]),
            ("3 split 6:3:1", 3, "split", [6.0, 3.0, 1.0])]
    if args.outside:
        print(f"outside: {args.outside} clients at each engine, straight to it, through every arm")
        arms = [arms[0], arms[2]]
    results = [await arm(name, processes, redis.url, upstream_ports, args, gateways, dispatch, weights, capacity)
               for name, gateways, dispatch, weights in arms]
    base = results[0]
    print(f"\n{'arm':<16}{'goodput/s':>10}{'ratio':>7}{'done/s':>8}{'refused/s':>10}{'P50 TTFT':>9}{'P99 TTFT':>9}"
          f"{'util':>6}{'waiting mean':>13}{'peak':>6}{'running peak':>13}"
          + (f"{'outside done/s':>15}{'P50 TTFT':>9}" if args.outside else ""))
    for r in results:
        print(f"{r.name:<16}{r.goodput:>10.2f}{r.goodput / base.goodput:>6.2f}x{r.completed:>8.2f}{r.refused:>10.2f}"
              f"{r.ttft_p50_s:>8.2f}s{r.ttft_p99_s:>8.2f}s{r.utilisation:>6.2f}{r.waiting_mean:>13.2f}"
              f"{r.waiting_peak:>6.0f}{r.running_peak:>13.0f}"
              + (f"{r.outside_completed:>15.2f}{r.outside_ttft_p50_s:>8.2f}s" if args.outside else ""))
    ok = True
    for r in results[1:] if args.outside else results[2:]:
        passed = r.goodput >= MIN_GOODPUT_RATIO * base.goodput and r.waiting_mean <= MAX_MEAN_WAITING
        ok &= passed
        print(f"{r.name}: goodput {r.goodput / base.goodput:.2f}x one gateway's (bar >= {MIN_GOODPUT_RATIO}), engines' "
              f"waiting mean {r.waiting_mean:.2f} (bar <= {MAX_MEAN_WAITING}), utilisation {r.utilisation:.2f} -> "
              f"{'PASS' if passed else 'FAIL'}")
    print(f"\n{'PASS' if ok else 'FAIL'}: active-active bar")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="each arm's measured window")
    parser.add_argument("--load", type=float, default=2.0, help="offered load as a multiple of capacity")
    parser.add_argument("--capacity-s", type=float, default=5.0)
    parser.add_argument("--knee", type=int, default=6, help="each engine's batch, and each gateway's slot_limit")
    parser.add_argument("--step-ms", type=float, default=25.0)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=19)
    parser.add_argument("--outside", type=int, default=0, help="clients at each engine sending past the gateways")
    parser.add_argument("--sim", action="store_true", help="the simulated arms instead (3 seeds), no processes")
    args = parser.parse_args()
    if args.sim:
        sys.path.insert(0, str(HERE.parent / "src"))
        from tidegate.sim.active_active import active_active

        verdict = active_active()
        print("\n".join(verdict.figures))
        print(f"{'PASS' if verdict.passed else 'FAIL'}: {verdict.bar}")
        return 0 if verdict.passed else 1
    processes = Processes(Path(tempfile.mkdtemp(prefix="tidegate-active-active-")))
    try:
        return asyncio.run(run(args, processes))
    finally:
        processes.stop_all()
        print(f"logs: {processes.workdir}")


if __name__ == "__main__":
    sys.exit(main())
