"""The autoscaler live (issue 17's live bar): `tidegate serve` with an embedded pool of one to two
workers; a step to 3x one worker's capacity must add a worker that takes traffic within 60 s of the
step, and the scale-in after the load drops must drain with zero failed requests.

Phases (open loop, Poisson arrivals, streamed chat of 16 tokens): one worker's capacity measured
first (closed loop, 16 in flight), then 0.5x it for 20 s, 3x for 60 s, 0.3x for 60 s. Every second
the bench reads the gateway's `/metrics` (desired and ready replicas) and `/status.json` (each
replica's health and requests held) and prints the timeline. "Refused" are overload control's
answers (429, or 503 with its preset reply) and are not failures; "failed" is anything else: a
5xx, a broken stream, a timeout, a connection error.

With `--standby 1` a third worker is kept loaded out of traffic: the step takes it at once, and a
new standby loads in the background. With `--replica-tokens-per-s X` the pool scales on the work
arriving (`autoscale.replica_tokens_per_s`: prompt + output tokens a second over X, one worker's
token throughput, which the capacity phase prints) instead of the requests it holds.

Run: flock /tmp/tidegate-bench.lock python bench/autoscale_live.py [--step 3] [--standby 1] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support import start_process, tidegate_argv  # noqa: E402

from tidegate.gateway.overload import estimate_prompt_tokens  # noqa: E402
from tidegate.ports import free_port  # noqa: E402

MODEL = "tiny-random-llama"
BODY = {"model": MODEL, "max_tokens": 16, "stream": True, "ignore_eos": True,
        "messages": [{"role": "user", "content": "tell me a story about the sea"}]}


@dataclass
class Outcome:
    sent_s: float
    status: str  # ok, refused, failed
    detail: str = ""


@dataclass
class Sample:
    t_s: float
    desired: float
    ready: float
    replicas: list[tuple[str, int]]  # (health, requests held)
    tokens_per_s: float | None = None  # the autoscaler's replica throughput, as set or measured


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)


async def one_request(session: aiohttp.ClientSession, url: str, run: Run, start_s: float) -> None:
    sent_s = time.monotonic() - start_s
    try:
        async with session.post(f"{url}/v1/chat/completions", json=BODY) as response:
            if response.status in (429, 503):
                await response.read()
                run.outcomes.append(Outcome(sent_s, "refused", str(response.status)))
                return
            if response.status != 200:
                run.outcomes.append(Outcome(sent_s, "failed", f"status {response.status}"))
                return
            done = False
            async for line in response.content:
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif b'"error"' in line:
                    run.outcomes.append(Outcome(sent_s, "failed", line.decode()[:120]))
                    return
            run.outcomes.append(Outcome(sent_s, "ok" if done else "failed", "" if done else "stream cut"))
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        run.outcomes.append(Outcome(sent_s, "failed", repr(error)[:120]))


async def capacity(session: aiohttp.ClientSession, url: str, seconds: float = 12.0, in_flight: int = 16) -> float:
    """Completed requests a second of a closed loop: one worker's capacity."""
    run, start_s = Run(), time.monotonic()
    deadline = start_s + seconds

    async def loop() -> None:
        while time.monotonic() < deadline:
            await one_request(session, url, run, start_s)

    await asyncio.gather(*(loop() for _ in range(in_flight)))
    return sum(1 for o in run.outcomes if o.status == "ok") / (time.monotonic() - start_s)


async def open_loop(session: aiohttp.ClientSession, url: str, run: Run, start_s: float,
                    phases: list[tuple[float, float]], rng: random.Random) -> None:
    """Poisson arrivals at each phase's rate for its length; at most 2,000 in flight (bounded)."""
    tasks: set[asyncio.Task] = set()
    t_s = time.monotonic() - start_s
    for rate, length_s in phases:
        end_s = t_s + length_s
        while True:
            t_s += rng.expovariate(rate)
            if t_s >= end_s:
                t_s = end_s
                break
            await asyncio.sleep(max(0.0, start_s + t_s - time.monotonic()))
            if len(tasks) < 2000:
                task = asyncio.get_running_loop().create_task(one_request(session, url, run, start_s))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)


async def sample(session: aiohttp.ClientSession, url: str, run: Run, start_s: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            async with session.get(f"{url}/metrics") as response:
                text = await response.text()
            gauges = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith(("tidegate_desired_replicas{", "tidegate_replicas_ready{",
                                          "tidegate_autoscale_replica_tokens_per_s{"))}
            async with session.get(f"{url}/status.json") as response:
                status = json.loads(await response.text())
            replicas = [(r["health"], r["outstanding"]) for r in status["pools"][0]["replicas"]]
            run.samples.append(Sample(time.monotonic() - start_s, gauges.get("tidegate_desired_replicas", 0.0),
                                      gauges.get("tidegate_replicas_ready", 0.0), replicas,
                                      gauges.get("tidegate_autoscale_replica_tokens_per_s")))
        except (aiohttp.ClientError, ValueError, KeyError):
            pass
        await asyncio.sleep(1.0)


def print_timeline(run: Run, phases: list[tuple[str, float, float]]) -> None:
    print(f"\n{'t s':>5} {'phase':>6} {'sent':>5} {'ok':>4} {'refused':>7} {'failed':>6}  desired ready  replicas (health:held)")
    for s in run.samples:
        second = [o for o in run.outcomes if s.t_s - 1.0 <= o.sent_s < s.t_s]
        phase = next((name for name, begin, end in phases if begin <= s.t_s < end), "-")
        print(f"{s.t_s:5.0f} {phase:>6} {len(second):5d} {sum(o.status == 'ok' for o in second):4d} "
              f"{sum(o.status == 'refused' for o in second):7d} {sum(o.status == 'failed' for o in second):6d}  "
              f"{s.desired:7.0f} {s.ready:5.0f}  " + " ".join(f"{h}:{held}" for h, held in s.replicas))


async def main_async(args: argparse.Namespace) -> int:
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="tidegate-autoscale-"))
    config = {"server": {"port": port, "access_log": False}, "health": {"interval_s": 0.5},
              "pools": [{"name": MODEL,
                         "backends": [{"type": "embedded", "model": MODEL, "count": 2 + args.standby, "threads": 1}],
                         "autoscale": {"min_replicas": 1, "max_replicas": 2, "tick_s": 1.0, "stable_window_s": 10,
                                       "panic_window_s": 3, "scale_down_window_s": 20, "standby": args.standby}}]}
    if args.replica_tokens_per_s is not None:
        config["pools"][0]["autoscale"]["replica_tokens_per_s"] = args.replica_tokens_per_s
    (work / "serve.yaml").write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{port}"
    gateway = start_process(tidegate_argv("serve", "--config", str(work / "serve.yaml")), ready_url=f"{url}/ready",
                            timeout_s=240)
    try:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            one = await capacity(session, url)
            tokens = estimate_prompt_tokens(BODY) + BODY["max_tokens"]  # as the gateway counts the work
            print(f"one worker's capacity: {one:.1f} req/s (closed loop, 16 in flight) = {one * tokens:.0f} tokens/s "
                  f"at {tokens} tokens a request; the pool scales on "
                  + ("requests held" if args.replica_tokens_per_s is None
                     else f"work, {args.replica_tokens_per_s:g} tokens/s a replica"))
            await asyncio.sleep(25.0)  # the closed loop's demand leaves the stable window: back to one worker
            scale = 0.5 if args.quick else 1.0
            lengths = (20.0 * scale, 60.0 * scale, 60.0 * scale)
            rates = (0.5 * one, args.step * one, 0.3 * one)
            run, stop = Run(), asyncio.Event()
            start_s = time.monotonic()
            sampler = asyncio.get_running_loop().create_task(sample(session, url, run, start_s, stop))
            await open_loop(session, url, run, start_s, list(zip(rates, lengths)), random.Random(7))
            await asyncio.sleep(5.0)
            stop.set()
            await sampler
    finally:
        gateway.stop(timeout_s=60)
    step_s, drop_s = lengths[0], lengths[0] + lengths[1]
    names = [("0.5x", 0.0, step_s), (f"{args.step:g}x", step_s, drop_s), ("0.3x", drop_s, float("inf"))]
    print_timeline(run, names)
    second_takes = next((s.t_s for s in run.samples if s.t_s >= step_s
                         and sum(1 for h, held in s.replicas if h == "healthy" and held > 0) >= 2), None)
    scaled_out_s = next((s.t_s for s in run.samples if s.t_s >= step_s and s.desired >= 2), None)
    serving_at_drop = max((sum(1 for h, _ in s.replicas if h == "healthy") for s in run.samples
                           if step_s <= s.t_s < drop_s), default=0)
    drained = next((s.t_s for s in run.samples if s.t_s >= drop_s
                    and sum(1 for h, _ in s.replicas if h == "healthy") < serving_at_drop), None)
    failed = [o for o in run.outcomes if o.status == "failed"]
    failed_after_drop = [o for o in failed if o.sent_s >= drop_s - 5.0]
    within = second_takes is not None and second_takes - step_s <= 60.0
    served = sum(o.status == "ok" for o in run.outcomes)
    print(f"\nrequests: {len(run.outcomes)} sent, {served} served, "
          f"{sum(o.status == 'refused' for o in run.outcomes)} refused, {len(failed)} failed")
    print(f"scale-out decided {_after(scaled_out_s, step_s)} after the step; the second worker takes traffic "
          f"{_after(second_takes, step_s)} after it (bar <= 60 s: {'PASS' if within else 'FAIL'})")
    print(f"scale-in: a worker drained {_after(drained, drop_s)} after the load dropped; failed requests from 5 s "
          f"before the drop on: {len(failed_after_drop)} (bar 0: {'PASS' if drained and not failed_after_drop else 'FAIL'})")
    measured = next(((s.t_s, s.tokens_per_s) for s in run.samples if s.tokens_per_s is not None), None)
    if args.replica_tokens_per_s is None:
        print("a worker's throughput as the autoscaler measured it (saturated ticks): "
              + ("never known" if measured is None else f"{run.samples[-1].tokens_per_s:.0f} tokens/s at the end, "
                 f"known from {measured[0]:.0f} s ({measured[1]:.0f}); the capacity phase: "
                 f"{one * tokens:.0f} tokens/s"))
    for outcome in failed[:5]:
        print(f"  failed at {outcome.sent_s:.1f} s: {outcome.detail}")
    return 0 if within and drained and not failed_after_drop else 1


def _after(t_s: float | None, since_s: float) -> str:
    return "never" if t_s is None else f"{t_s - since_s:.0f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", type=float, default=3.0, help="the step's load, in multiples of one worker's capacity")
    parser.add_argument("--quick", action="store_true", help="phases half as long")
    parser.add_argument("--standby", type=int, default=0, help="warm standby workers (one more worker each)")
    parser.add_argument("--replica-tokens-per-s", type=float, default=None,
                        help="scale on work demand with this per-worker token throughput (measured)")
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
