"""Overload policies on a modelled pool: goodput at 1x, 2x and 4x capacity, FIFO beside tidegate.

A policy-level discrete-event simulation (no HTTP, no engine): one pool of fixed slots, Poisson
arrivals of a tier mix, each request's service = prefill + output tokens x inter-token time. The
FIFO baseline queues everything in arrival order; tidegate drives `OverloadControl` (prediction,
degradation, fair priority queue, deadlines). Goodput = requests that finish with TTFT within
their tier's target, per second. Also prints the CPU cost of each policy decision (the gateway's
own rejection latency is bounded by it). The live measurement on `tidegate serve` comes later.

Run: flock /tmp/tidegate-bench.lock python bench/overload_policies.py
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass

from tidegate.policy.admission import RateLimiter
from tidegate.policy.overload import ArrivalOutcome, OverloadControl, PoolPolicies
from tidegate.policy.tiers import default_tiers
from tidegate.types import PoolRequest

TIERS = default_tiers()
MIX = (("critical", 0.2), ("standard", 0.5), ("sheddable", 0.3))
PREFILL_S = 0.2
ITL_S = 0.02
MAX_TOKENS = 200


@dataclass
class Job:
    request_id: str
    tier: str
    tenant: str
    arrival_s: float
    output_tokens: int
    ttft_s: float | None = None


@dataclass
class Outcome:
    goodput_per_s: float
    served: int
    refused: int
    critical_p99_ttft_s: float
    decision_us: list[float]


def _arrivals(rate_per_s: float, duration_s: float, seed: int) -> list[Job]:
    rng = random.Random(seed)
    jobs, now_s = [], 0.0
    while True:
        now_s += rng.expovariate(rate_per_s)
        if now_s >= duration_s:
            return jobs
        tier = rng.choices([name for name, _ in MIX], [weight for _, weight in MIX])[0]
        jobs.append(Job(f"r{len(jobs)}", tier, f"t{rng.randrange(5)}", now_s, rng.randint(20, 180)))


def _service_s(job: Job) -> float:
    return PREFILL_S + job.output_tokens * ITL_S


def _p99(values: list[float]) -> float:
    return sorted(values)[int(0.99 * (len(values) - 1))] if values else float("nan")


def _summarise(jobs: list[Job], duration_s: float, decision_us: list[float]) -> Outcome:
    served = [job for job in jobs if job.ttft_s is not None]
    good = [job for job in served if job.ttft_s <= TIERS[job.tier].ttft_target_s]
    critical = [job.ttft_s for job in served if job.tier == "critical"]
    return Outcome(len(good) / duration_s, len(served), len(jobs) - len(served), _p99(critical), decision_us)


def run_fifo(jobs: list[Job], slots: int, duration_s: float) -> Outcome:
    waiting: deque[Job] = deque()
    completions: list[float] = []
    free = slots
    for job in jobs + [None]:  # None drains what is left after the last arrival
        now_s = job.arrival_s if job is not None else float("inf")
        while completions and completions[0] <= now_s:
            done_s = heapq.heappop(completions)
            free += 1
            if waiting:  # the freed slot takes the oldest waiting request
                nxt = waiting.popleft()
                free -= 1
                nxt.ttft_s = done_s - nxt.arrival_s + PREFILL_S
                heapq.heappush(completions, done_s + _service_s(nxt))
        if job is None:
            break
        if free:
            free -= 1
            job.ttft_s = PREFILL_S
            heapq.heappush(completions, now_s + _service_s(job))
        else:
            waiting.append(job)
    return _summarise(jobs, duration_s, [])


def run_tidegate(jobs: list[Job], slots: int, duration_s: float) -> Outcome:
    control = OverloadControl(TIERS, RateLimiter(), {"m": PoolPolicies.create("m", TIERS, max_queued=10_000)})
    by_id = {job.request_id: job for job in jobs}
    completions: list[tuple[float, str]] = []
    free, decision_us = slots, []

    def start(now_s: float) -> None:
        nonlocal free
        while free:
            t0 = time.perf_counter()
            dispatch = control.dispatch(now_s, "m")
            decision_us.append((time.perf_counter() - t0) * 1e6)
            if dispatch.request is None:
                return
            free -= 1
            job = by_id[dispatch.request.request_id]
            job.ttft_s = now_s - job.arrival_s + PREFILL_S
            heapq.heappush(completions, (now_s + _service_s(job), job.request_id))

    for job in jobs + [None]:
        now_s = job.arrival_s if job is not None else float("inf")
        while completions and completions[0][0] <= now_s:
            done_s, request_id = heapq.heappop(completions)
            free += 1
            control.finish(done_s, request_id, prompt_tokens=100, completion_tokens=by_id[request_id].output_tokens)
            start(done_s)
        if job is None:
            break
        t0 = time.perf_counter()
        arrival = control.arrive(now_s, "m", PoolRequest(job.request_id, now_s, job.tenant, job.tier, 100, MAX_TOKENS))
        decision_us.append((time.perf_counter() - t0) * 1e6)
        if arrival.outcome is ArrivalOutcome.QUEUED:
            start(now_s)
    return _summarise(jobs, duration_s, decision_us)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()

    capacity_per_s = args.slots / (PREFILL_S + ITL_S * 100)  # mean output 100 tokens
    print(f"modelled pool: {args.slots} slots, capacity {capacity_per_s:.2f} req/s; mix {dict(MIX)}; "
          f"{args.duration_s:.0f} s per run; goodput = finished with TTFT within the tier target")
    print(f"{'load':>5} {'FIFO goodput/s':>15} {'vs 1x':>6} {'tidegate goodput/s':>19} {'vs 1x':>6} "
          f"{'refused':>8} {'crit p99 TTFT s (FIFO | tidegate)':>34}")
    base: dict[str, float] = {}
    all_decisions: list[float] = []
    for load in (1.0, 2.0, 4.0):
        jobs = _arrivals(load * capacity_per_s, args.duration_s, args.seed)
        fifo = run_fifo([Job(**vars(job)) for job in jobs], args.slots, args.duration_s)
        tide = run_tidegate([Job(**vars(job)) for job in jobs], args.slots, args.duration_s)
        base.setdefault("fifo", fifo.goodput_per_s)
        base.setdefault("tide", tide.goodput_per_s)
        all_decisions += tide.decision_us
        print(f"{load:4.0f}x {fifo.goodput_per_s:15.2f} {fifo.goodput_per_s / base['fifo']:6.2f} "
              f"{tide.goodput_per_s:19.2f} {tide.goodput_per_s / base['tide']:6.2f} {tide.refused:8d} "
              f"{fifo.critical_p99_ttft_s:16.2f} | {tide.critical_p99_ttft_s:.2f}")
    print(f"policy decision CPU time (arrive or dispatch, {len(all_decisions)} calls, 1 thread): "
          f"median {statistics.median(all_decisions):.1f} us, p99 {_p99(all_decisions):.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
