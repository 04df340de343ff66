"""Where a protected request's time goes in the `critical_burst` and `noisy_tenant` scenarios, step by step.

    python bench/protection_anatomy.py [--scenario critical_burst|noisy_tenant] [--seeds 10]

The scenario's bar: critical P99 TTFT during a 3x sheddable burst <= 1.2x the same requests' P99
unloaded. This runs the scenario's seeds through the simulator with every engine step an event,
and splits each critical request's TTFT (in the burst's window) into:
- queue: arrival to dispatch, at the gateway (the controller's share of the wait);
- in-flight step: dispatch to the end of the step its replica was running then (an engine step
  cannot be interrupted; a sheddable prefill step is ~78 ms on this engine model);
- worse work in its own steps: what the sheddable chunks and decodes scheduled beside it added to
  the steps that computed its prompt (the cost model with and without them);
- the rest: its own prompt's steps, and what equal or better work shared them.
`--scenario noisy_tenant` does the same for the quiet tenants' requests beside a flood (bar < 1.1x).
`--work` splits noisy_tenant's requests within target, control against FIFO, at the flood's end.
`--tail` splits the TTFTs that set each run's P99, the unloaded run's beside the loaded one's, into
queue, in-flight step, waiting in the engine after it, and the prompt's own steps (worse work in them).
It then prints the P99 ratio with each part taken away, so the bound is a number: a P99 that is
over 1.2x with the controller's queue at zero and only the in-flight step added cannot be brought
under the bar by any dispatch policy, only by shorter engine steps (which cost throughput: the
step's fixed cost paid more often) or by interrupting steps.

Two bounds follow, for the best any routing could do on the same engine steps. Routing cannot
shorten a step, but it could pick the replica whose step in flight ends first, if it knew the
engines' step phases (no engine exports them; the gateway sees a step's end only when a token of
it arrives):
- "best phase, steps as run": each request waits only for the earliest end of a step in flight
  over the replicas, then takes as long as it took from its own replica's step end;
- "best phase, own steps alone": that wait, then its prompt's steps with nothing else in them (no
  decodes, no worse chunks beside it): the floor, which no engine running other sequences reaches.
A seed over the bar on the first bound needs more than routing; over it on the second, more than
any scheduler that lets the step in flight finish.
"""

from __future__ import annotations

import argparse
import bisect
from collections import defaultdict
from dataclasses import replace

import numpy as np

from tidegate.engine.scheduler import ScheduledBatch
from tidegate.policy.tiers import default_tiers
from tidegate.sim import scenarios as S
from tidegate.sim.harness import Harness, RequestRecord

class StepLog:
    """Every step of every replica: start, duration and the batch."""

    def __init__(self) -> None:
        self.starts: dict[str, list[float]] = defaultdict(list)
        self.steps: dict[str, list[tuple[float, float, ScheduledBatch]]] = defaultdict(list)

    def __call__(self, replica_id: str, start_s: float, step_s: float, batch: ScheduledBatch) -> None:
        self.starts[replica_id].append(start_s)
        self.steps[replica_id].append((start_s, step_s, batch))

    def in_flight_end(self, replica_id: str, at_s: float) -> float:
        """End of the step `replica_id` was running at `at_s` (`at_s` itself when none was)."""
        index = bisect.bisect_right(self.starts[replica_id], at_s) - 1
        if index < 0:
            return at_s
        start_s, step_s, _ = self.steps[replica_id][index]
        return max(at_s, start_s + step_s)

    def first_chunk_s(self, record: RequestRecord) -> float:
        """Start of the first step that computed part of `record`'s prompt."""
        index = bisect.bisect_left(self.starts[record.replica_id], record.dispatch_s)
        for start_s, _, batch in self.steps[record.replica_id][index:]:
            if any(chunk.seq.seq_id == record.request_id for chunk in batch.chunks):
                return start_s
        raise ValueError(f"request {record.request_id}: no step computed its prompt")

    def worse_work_s(self, spec: S.ReplicaSpec, record: RequestRecord) -> float:
        """What chunks of a worse engine priority than its own added to the steps that computed
        `record`'s prompt."""
        added = 0.0
        index = bisect.bisect_left(self.starts[record.replica_id], record.dispatch_s)
        for start_s, step_s, batch in self.steps[record.replica_id][index:]:
            if start_s >= record.first_token_s:
                break
            own = [chunk for chunk in batch.chunks if chunk.seq.seq_id == record.request_id]
            if not own:
                continue
            priority = own[0].seq.priority
            kept = [chunk for chunk in batch.chunks if chunk.seq.priority <= priority]
            decodes = sum(1 for chunk in kept if chunk.seq.is_decoding and chunk.num_tokens == 1
                          and chunk.start >= len(chunk.seq.prompt_token_ids))
            prefill = sum(chunk.num_tokens for chunk in kept) - decodes
            context = sum(chunk.start + chunk.num_tokens for chunk in kept)
            added += step_s - spec.cost.step_s(prefill, decodes, context)
        return added


def own_steps_s(spec: S.ReplicaSpec, prompt_tokens: int) -> float:
    """A prompt's prefill steps with nothing but its own chunks in them, each a full token budget."""
    budget, done, total_s = spec.scheduler.max_batch_tokens, 0, 0.0
    while done < prompt_tokens:
        chunk = min(budget, prompt_tokens - done)
        total_s += spec.cost.step_s(chunk, 0, done + chunk)
        done += chunk
    return total_s


def run_logged(requests, log: StepLog | None, window: tuple[float, float]) -> S.ScenarioRun:
    ids = [f"r{i}" for i in range(S.REPLICAS)]
    specs = [replace(S.replica_spec(i), stretches=log is None) for i in ids]
    harness = Harness(specs, S.controller(ids, default_tiers()))
    if log is not None:
        for replica in harness.replicas.values():
            replica.step_observer = log
    return S.ScenarioRun(harness.run(requests, probes_s=window), default_tiers())


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99))


def critical_burst_seed(seed: int, cap: float):
    """(requests with the burst, the same without it, which records the bar is about, window)"""
    critical = S.mixed(0.15 * cap, S.DURATION_S, (("vip", "critical", 1.0),), seed=seed)
    burst = S.mixed(3.0 * cap, 30.0, (("bulk", "sheddable", 1.0),), seed=seed + 1)
    return S._merge(critical, burst, offsets_s=(0.0, 15.0)), critical, lambda r: r.tier == "critical", (15.0, 45.0)


def noisy_tenant_seed(seed: int, cap: float):
    quiet = S.mixed(0.6 * cap, S.DURATION_S, tuple((f"t{i}", "standard", 1.0) for i in range(4)), seed=seed)
    noisy = S.mixed(1.5 * cap, 40.0, (("noisy", "standard", 1.0),), seed=seed + 1)
    return S._merge(quiet, noisy, offsets_s=(0.0, 10.0)), quiet, lambda r: r.tenant != "noisy", (15.0, 50.0)


QUIET_AFTER_S = 6.0  # the seconds after the flood in which FIFO's backlog delays the others


def noisy_work(seeds) -> None:
    """noisy_tenant's work-conservation deficit against FIFO, split at the flood's end (t = 50 s)."""
    cap = S.capacity_rps(S.REPLICAS)
    flood_end_s = 50.0
    print("noisy_tenant: requests within target, control vs FIFO, and the backlog each has when the flood ends")
    for seed in seeds:
        requests, _, _, _ = noisy_tenant_seed(seed, cap)
        figures, quiet_after = [], []
        for kind in (S.controller, S.fifo):
            run_ = S.run(kind, S.REPLICAS, requests, probes_s=(flood_end_s,))
            target_s = run_.tiers["standard"].ttft_target_s
            after = sum(1 for r in run_.result.records if r.served and r.arrival_s < flood_end_s <= r.first_token_s
                        and r.ttft_s <= target_s)
            figures.append((run_.good(), run_.result.probes[0].queued, after))
            # what serving the backlog first costs the others: their requests of the seconds after the flood
            quiet = [r for r in run_.records("standard", flood_end_s, flood_end_s + QUIET_AFTER_S)
                     if r.tenant != "noisy"]
            ttfts = [r.ttft_s for r in quiet if r.ttft_s is not None]
            quiet_after.append(f"P50 {np.percentile(ttfts, 50) * 1000:.0f} / P99 {p99(ttfts) * 1000:.0f} ms, "
                               f"within target {run_.good(quiet)} of {len(quiet)}")
        (good, queued, after), (fifo_good, fifo_queued, fifo_after) = figures
        print(f"seed {seed}: within target {good} vs FIFO {fifo_good} ({good - fifo_good:+d}); queued at the flood's end "
              f"{queued} vs {fifo_queued}; of those, served within target after it {after} vs {fifo_after} "
              f"({after - fifo_after:+d}); the rest {good - after - (fifo_good - fifo_after):+d}")
        print(f"    the others' requests of the {QUIET_AFTER_S:.0f} s after the flood: {quiet_after[0]} (FIFO "
              f"{quiet_after[1]})")


def tail_parts(spec: S.ReplicaSpec, log: StepLog, record: RequestRecord) -> tuple[float, ...]:
    """`record`'s TTFT in parts, seconds: (queue at the gateway, the step in flight at dispatch,
    waiting in the engine after it, its prompt's steps, of which worse work)."""
    in_flight_end_s = log.in_flight_end(record.replica_id, record.dispatch_s)
    first_chunk_s = log.first_chunk_s(record)
    return (record.dispatch_s - record.arrival_s, in_flight_end_s - record.dispatch_s,
            first_chunk_s - in_flight_end_s, record.first_token_s - first_chunk_s, log.worse_work_s(spec, record))


TAIL = 3  # the requests with the longest TTFTs: the P99 of some fifty is between the first two


def tail(make, seeds) -> None:
    """The TTFTs that set each run's P99, in parts, unloaded beside loaded: where the extra time goes."""
    cap = S.capacity_rps(S.REPLICAS)
    spec = S.replica_spec("r0")
    print(f"the {TAIL} longest TTFTs of each run, in ms: queue at the gateway + step in flight at dispatch + "
          "waiting in the engine after it + its prompt's steps (of which worse work) = TTFT; prompt tokens")
    sums = {"unloaded": np.zeros(5), "loaded": np.zeros(5)}
    for seed in seeds:
        requests, alone_requests, about, window = make(seed, cap)
        print(f"seed {seed}")
        for label, run_requests in (("unloaded", alone_requests), ("loaded", requests)):
            log = StepLog()
            run_ = run_logged(run_requests, log, window)
            records = sorted((r for r in run_.records(None, *window) if about(r) and r.first_token_s is not None),
                             key=lambda r: r.ttft_s, reverse=True)[:TAIL]
            for record in records:
                parts = np.asarray(tail_parts(spec, log, record))
                sums[label] += parts
                queue, in_flight, engine, steps, worse = parts * 1000
                print(f"  {label:<8} {queue:5.1f} + {in_flight:5.1f} + {engine:5.1f} + {steps:6.1f} ({worse:5.1f}) = "
                      f"{record.ttft_s * 1000:6.1f}; {record.prompt_tokens:5d}")
    count = TAIL * len(seeds)
    for label, total in sums.items():
        queue, in_flight, engine, steps, worse = total / count * 1000
        print(f"mean {label:<8} {queue:5.1f} + {in_flight:5.1f} + {engine:5.1f} + {steps:6.1f} ({worse:5.1f}) ms")


SCENARIOS = {"critical_burst": (critical_burst_seed, S.BURST_SEEDS), "noisy_tenant": (noisy_tenant_seed, S.NOISY_SEEDS)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="critical_burst")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--work", action="store_true", help="noisy_tenant's work-conservation deficit instead")
    parser.add_argument("--tail", action="store_true", help="the TTFTs that set the P99, in parts, unloaded and loaded")
    args = parser.parse_args()
    if args.tail:
        make, seeds = SCENARIOS[args.scenario]
        tail(make, seeds[:args.seeds])
        return
    if args.work:
        noisy_work(S.NOISY_SEEDS[:args.seeds])
        return
    cap = S.capacity_rps(S.REPLICAS)
    spec = S.replica_spec("r0")
    make, seeds = SCENARIOS[args.scenario]
    print(f"{args.scenario}; engine model: {spec.scheduler.max_batch_tokens}-token steps, base "
          f"{spec.cost.base_s * 1000:.0f} ms; a full prefill step "
          f"{spec.cost.step_s(spec.scheduler.max_batch_tokens, 0, 0) * 1000:.0f} ms")
    print(f"{'seed':>5} {'unloaded':>9} {'loaded':>7} {'ratio':>6} | {'queue p99':>9} | in-flight step p50/p99/max"
          f" {'':>6} | worse work p99 | ratio w/o in-flight | w/o in-flight, w/o worse work"
          f" | earliest step end p99 | best phase, steps as run | best phase, own steps alone")
    worst, unloaded_all, bounds = [], [], []
    for seed in seeds[:args.seeds]:
        requests, alone_requests, about, window = make(seed, cap)
        alone = S.run(S.controller, S.REPLICAS, alone_requests)
        log = StepLog()
        loaded = run_logged(requests, log, window)
        unloaded_p99 = alone.p99_ttft_s([r for r in alone.records(None, *window) if about(r)])
        records = [r for r in loaded.records(None, *window) if about(r) and r.first_token_s is not None]
        ttft = [r.ttft_s for r in records]
        queue = [r.dispatch_s - r.arrival_s for r in records]
        in_flight = [log.in_flight_end(r.replica_id, r.dispatch_s) - r.dispatch_s for r in records]
        worse = [log.worse_work_s(spec, r) for r in records]
        without_in_flight = [t - w for t, w in zip(ttft, in_flight)]
        without_both = [t - w - x for t, w, x in zip(ttft, in_flight, worse)]
        # the wait a request would have had on the replica whose step in flight ended first
        earliest = [min(log.in_flight_end(replica_id, r.arrival_s) for replica_id in log.starts) - r.arrival_s
                    for r in records]
        phase_as_run = [e + r.first_token_s - log.in_flight_end(r.replica_id, r.dispatch_s)
                        for e, r in zip(earliest, records)]
        phase_alone = [e + own_steps_s(spec, r.prompt_tokens) for e, r in zip(earliest, records)]
        bounds.append((p99(phase_as_run) / unloaded_p99, p99(phase_alone) / unloaded_p99))
        ratio = p99(ttft) / unloaded_p99
        worst.append(ratio)
        unloaded_all.append(unloaded_p99)
        print(f"{seed:>5} {unloaded_p99 * 1000:7.0f}ms {p99(ttft) * 1000:5.0f}ms {ratio:5.2f}x | "
              f"{p99(queue) * 1000:7.1f}ms | {np.percentile(in_flight, 50) * 1000:5.1f} / {p99(in_flight) * 1000:5.1f} / "
              f"{max(in_flight) * 1000:5.1f} ms | {p99(worse) * 1000:10.1f} ms | "
              f"{p99(without_in_flight) / unloaded_p99:17.2f}x | {p99(without_both) / unloaded_p99:15.2f}x | "
              f"{p99(earliest) * 1000:16.1f} ms | {bounds[-1][0]:23.2f}x | {bounds[-1][1]:26.2f}x")
    print(f"worst ratio {max(worst):.2f}x, mean {np.mean(worst):.2f}x; the in-flight step is an engine step the "
          "request arrived during: no dispatch decision can shorten it")
    bar = 1.2 if args.scenario == "critical_burst" else 1.1
    print(f"best phase routing, steps as run: worst {max(b for b, _ in bounds):.2f}x, "
          f"{sum(b <= bar for b, _ in bounds)} of {len(bounds)} seeds within {bar}x; own steps alone: worst "
          f"{max(b for _, b in bounds):.2f}x, {sum(b <= bar for _, b in bounds)} of {len(bounds)} within")
    allowance_s = (bar - 1.0) * min(unloaded_all)
    decodes = S.CEILING
    tokens = (allowance_s - spec.cost.base_s - spec.cost.decode_s(decodes)) / spec.cost.prefill_s_per_token
    print(f"the bar allows {allowance_s * 1000:.0f} ms over the unloaded P99; a step that short, beside {decodes} "
          f"decodes, holds at most {max(0, int(tokens))} prefill tokens (full steps: {spec.scheduler.max_batch_tokens})")


if __name__ == "__main__":
    main()
