"""The overload scenarios: each a seeded run of the pool controller beside FIFO, with its bar.

Every scenario drives `policy.pool.PoolController` (the one brain) and, for reference, FIFO
(overload control off: `sim.fifo.FifoDispatcher`, no engine priority) through the same requests on
the same modelled replicas, and returns a `Verdict`: the bar, whether it holds, and the figures
behind it, utilisation and work served printed beside every protection figure.
`bench/overload_scenarios.py` prints them; `tests/sim/test_scenarios.py` asserts them.

The replicas model a GPU engine (a 512-token step budget, 48 sequences, prefill ~10k tokens/s);
the form matters more than the figures. Load is stated as a multiple of the capacity measured on
the same model (`sim.capacity`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cache

import numpy as np

from tidegate.engine.scheduler import SchedulerConfig
from tidegate.loadgen.arrivals import Poisson
from tidegate.loadgen.mix import LengthDistribution
from tidegate.policy.pool import PoolController, PoolReplica, PoolSettings
from tidegate.policy.shares import TenantShares
from tidegate.policy.tiers import TierTable, default_tiers
from tidegate.sim.capacity import saturated_rps
from tidegate.sim.fifo import FifoDispatcher
from tidegate.sim.harness import (ClosedLoopClients, Harness, KillReplica, RequestRecord, RunResult, ScenarioEvent,
                                  SlowReplica, TrafficClass, make_requests)
from tidegate.sim.profile import load_profile
from tidegate.sim.replica import ReplicaSpec, StepCostModel
from tidegate.sim.seam import Dispatcher, SimRequest

__all__ = ["CEILING", "Verdict", "PairedGood", "ScenarioRun", "replica_spec", "capacity_rps", "run", "SCENARIOS", "run_all"]

CEILING = 32  # the backend's slot_limit: requests one replica holds, the same for FIFO
HEADROOM = 16  # the engine runs up to CEILING + HEADROOM sequences; only the controller uses the rest
CHAT_PROMPT = LengthDistribution("uniform", 64, 1024)
CHAT_OUTPUT = LengthDistribution("uniform", 32, 256)
LONG_PROMPT = LengthDistribution("uniform", 1000, 3000)


def replica_spec(replica_id: str) -> ReplicaSpec:
    # a 7-8B model on one data-centre GPU, roughly: a memory-bound step of ~20 ms that a bigger
    # decode batch barely slows, ~10k prompt tokens a second
    return ReplicaSpec(replica_id, scheduler=SchedulerConfig(max_num_seqs=CEILING + HEADROOM, max_batch_tokens=512),
                       kv_cache_tokens=262144,
                       cost=StepCostModel(base_s=0.020, prefill_s_per_token=0.0001, decode_s_per_seq=0.0002,
                                          context_s_per_token=1.5e-7))


@cache
def capacity_rps(replicas: int, prompt_tokens: int = 544, output_tokens: int = 144) -> float:
    """Requests a second `replicas` replicas serve at the mean chat shape, saturated."""
    return replicas * saturated_rps(replica_spec("r0"), prompt_tokens, output_tokens, CEILING)


def chat(tenant: str, tier: str, share: float = 1.0, prompt: LengthDistribution = CHAT_PROMPT) -> TrafficClass:
    return TrafficClass(tenant, tier, share, prompt, CHAT_OUTPUT)


@dataclass(frozen=True, slots=True)
class Verdict:
    scenario: str
    bar: str
    passed: bool
    figures: tuple[str, ...]  # lines printed under the verdict
    values: tuple[tuple[str, float], ...] = ()  # the bar's figures by name, for tests

    def value(self, name: str) -> float:
        return dict(self.values)[name]


@dataclass(frozen=True, slots=True)
class ScenarioRun:
    result: RunResult
    tiers: TierTable

    def records(self, tier: str | None = None, start_s: float = 0.0, end_s: float = float("inf"),
                tenant: str | None = None) -> list[RequestRecord]:
        return [r for r in self.result.records if (tier is None or r.tier == tier) and start_s <= r.arrival_s < end_s
                and (tenant is None or r.tenant == tenant)]

    def good(self, records: Sequence[RequestRecord] | None = None) -> int:
        """Requests served with a TTFT within their tier's target."""
        records = self.result.records if records is None else records
        return sum(1 for r in records if r.served and r.ttft_s is not None
                   and r.ttft_s <= self.tiers[r.tier].ttft_target_s)

    def completed_good(self, start_s: float, end_s: float) -> int:
        """Requests that finished in [start_s, end_s) with a TTFT within their tier's target."""
        return sum(1 for r in self.result.records if r.finish_s is not None and start_s <= r.finish_s < end_s
                   and r.ttft_s is not None and r.ttft_s <= self.tiers[r.tier].ttft_target_s)

    def served(self, records: Sequence[RequestRecord] | None = None) -> int:
        return sum(1 for r in (self.result.records if records is None else records) if r.served)

    def refused(self, records: Sequence[RequestRecord] | None = None) -> int:
        return sum(1 for r in (self.result.records if records is None else records) if r.refused_reason is not None)

    @staticmethod
    def p99_ttft_s(records: Sequence[RequestRecord]) -> float:
        ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
        return float(np.percentile(ttfts, 99)) if ttfts else float("nan")

    def busy(self, start_s: float, end_s: float) -> float:
        return self.result.busy_fraction(start_s, end_s)


Kind = Callable[[Sequence[str], TierTable], Dispatcher]


def controller(ids: Sequence[str], tiers: TierTable, settings: PoolSettings = PoolSettings(),
               kv_cache_tokens: int | None = None) -> PoolController:
    """`kv_cache_tokens`: each replica's KV cache as configured, over what its modelled engine reports."""
    return PoolController([PoolReplica(i, CEILING, HEADROOM, kv_cache_tokens=kv_cache_tokens) for i in ids], tiers,
                          settings, shares=TenantShares())


def fifo(ids: Sequence[str], tiers: TierTable) -> FifoDispatcher:
    return FifoDispatcher(ids, tiers, slot_limit=CEILING)


def run(kind: Kind, replicas: int, requests: Sequence[SimRequest], *, events: Sequence[ScenarioEvent] = (),
        clients: ClosedLoopClients | None = None, probes_s: Sequence[float] = (),
        tiers: TierTable | None = None, refusal_cpu_s: float = 0.0) -> ScenarioRun:
    tiers = tiers or default_tiers()
    ids = [f"r{i}" for i in range(replicas)]
    dispatcher = kind(ids, tiers)
    result = Harness([replica_spec(i) for i in ids], dispatcher, refusal_cpu_s=refusal_cpu_s).run(
        requests, events, clients=clients, probes_s=probes_s)
    return ScenarioRun(result, tiers)


def mixed(rate_rps: float, duration_s: float, shares: Sequence[tuple[str, str, float]], seed: int,
          prompt: LengthDistribution = CHAT_PROMPT) -> tuple[SimRequest, ...]:
    """Poisson arrivals of one chat shape, each then given a (tenant, tier) by share: the classes'
    lengths come from one stream, so priority cannot look better or worse by a class's heavier draw."""
    one = make_requests(Poisson(rate_rps), duration_s, [TrafficClass("-", "-", 1.0, prompt, CHAT_OUTPUT)], seed)
    weights = np.asarray([share for _, _, share in shares], dtype=np.float64)
    which = np.random.default_rng(seed + 1000).choice(len(shares), size=len(one), p=weights / weights.sum())
    return tuple(SimRequest(r.request_id, r.arrival_s, shares[k][0], shares[k][1], r.prompt_tokens, r.output_tokens)
                 for r, k in zip(one, which))


def _merge(*streams: Sequence[SimRequest], offsets_s: Sequence[float] = ()) -> tuple[SimRequest, ...]:
    """Several seeded streams as one, each shifted by its offset, ids renumbered by arrival."""
    shifted = []
    for index, stream in enumerate(streams):
        offset_s = offsets_s[index] if index < len(offsets_s) else 0.0
        shifted += [SimRequest(0, r.arrival_s + offset_s, r.tenant, r.tier, r.prompt_tokens, r.output_tokens)
                    for r in stream]
    shifted.sort(key=lambda r: r.arrival_s)
    return tuple(SimRequest(i, r.arrival_s, r.tenant, r.tier, r.prompt_tokens, r.output_tokens)
                 for i, r in enumerate(shifted))


def _work_line(label: str, run_: ScenarioRun, start_s: float, end_s: float) -> str:
    window = run_.records(start_s=start_s, end_s=end_s)
    return (f"{label:<10} busy {run_.busy(start_s, end_s):6.1%}  served {run_.served(window):5d}  "
            f"within target {run_.good(window):5d}  refused {run_.refused(window):5d}")


def _conserves(ctl: ScenarioRun, ref: ScenarioRun, start_s: float, end_s: float) -> bool:
    """Work conservation on one run: replicas >= 80 % busy, and at least FIFO's requests within target."""
    window_ctl, window_ref = ctl.records(start_s=start_s, end_s=end_s), ref.records(start_s=start_s, end_s=end_s)
    return ctl.busy(start_s, end_s) >= 0.8 and ctl.good(window_ctl) >= ref.good(window_ref)


@dataclass(frozen=True, slots=True)
class PairedGood:
    """Requests served within their tier's target over whole runs, the controller's less FIFO's, seed by
    seed on the same requests. Counted over the whole run, not by arrival in a window: a controller
    that serves the critical requests arriving after the window, which FIFO refuses, would otherwise
    be charged for the sheddable ones FIFO served in their place (`critical_burst`: 4047 against
    4257 by arrival over ten seeds, 4507 against 4631 over the whole runs). "At least FIFO's" is
    read as "not significantly fewer": two seeds of equal policies differ by a dozen requests
    (which one finishes just in time), so the shortfall of the sum must stay within two standard
    errors of the paired differences; a systematic loss of 2 % fails."""

    differences: tuple[int, ...]
    good: int
    fifo_good: int

    @classmethod
    def of(cls, pairs: Sequence[tuple[ScenarioRun, ScenarioRun]]) -> PairedGood:
        goods = [(ctl.good(), ref.good()) for ctl, ref in pairs]
        return cls(tuple(a - b for a, b in goods), sum(a for a, _ in goods), sum(b for _, b in goods))

    @property
    def noise(self) -> float:
        """Two standard errors of the summed paired difference."""
        if len(self.differences) < 2:
            return 0.0
        return 2.0 * float(np.std(self.differences, ddof=1)) * len(self.differences) ** 0.5

    @property
    def holds(self) -> bool:
        return self.good >= self.fifo_good - self.noise

    def line(self) -> str:
        return (f"within target over {len(self.differences)} whole runs {self.good} (FIFO {self.fifo_good}); "
                f"difference {self.good - self.fifo_good:+d}, noise +-{self.noise:.0f} "
                f"(per seed {list(self.differences)})")


# ---- scenarios ------------------------------------------------------------------------------------

REPLICAS = 2
DURATION_S = 60.0
# requests arriving in this window are counted: past the first seconds, and before the end, where
# a queue that holds more serves on while arrivals have stopped (a tail no endless overload has)
WINDOW = (5.0, 45.0)


GOODPUT_SEEDS = (11, 12, 13, 14, 15, 16, 17, 18)


def goodput(seeds: Sequence[int] = GOODPUT_SEEDS) -> Verdict:
    """Goodput at 2x and 4x capacity >= 90 % of goodput at 1x (no collapse past capacity), means over
    `seeds`; and at 2x and 4x, work conserved (`PairedGood`, replicas >= 80 % busy)."""
    cap = capacity_rps(REPLICAS)
    rates, lines, values, conserved = {}, [], [], True
    start_s, end_s = WINDOW
    for load in (1.0, 2.0, 4.0):
        pairs = []
        for seed in seeds:
            requests = mixed(load * cap, DURATION_S, (("a", "standard", 0.8), ("b", "critical", 0.2)), seed=seed)
            pairs.append((run(controller, REPLICAS, requests, probes_s=WINDOW),
                          run(fifo, REPLICAS, requests, probes_s=WINDOW)))
        rates[load] = float(np.mean([ctl.good(ctl.records(start_s=start_s, end_s=end_s)) for ctl, _ in pairs])) \
            / (end_s - start_s)
        fifo_rate = float(np.mean([ref.good(ref.records(start_s=start_s, end_s=end_s)) for _, ref in pairs])) \
            / (end_s - start_s)
        busy = min(ctl.busy(*WINDOW) for ctl, _ in pairs)
        paired = PairedGood.of(pairs)
        lines += [f"{load:.0f}x: goodput {rates[load]:.2f}/s (FIFO {fifo_rate:.2f}/s), mean of {len(seeds)} seeds; "
                  f"busy >= {busy:.1%}", "  " + paired.line(),
                  "  first seed: " + _work_line("control", pairs[0][0], *WINDOW),
                  "  first seed: " + _work_line("FIFO", pairs[0][1], *WINDOW)]
        values += [(f"goodput_{load:.0f}x", rates[load]), (f"good_{load:.0f}x", float(paired.good)),
                   (f"fifo_good_{load:.0f}x", float(paired.fifo_good)), (f"noise_{load:.0f}x", paired.noise)]
        if load > 1:
            conserved = conserved and paired.holds and busy >= 0.8
    passed = min(rates[2.0], rates[4.0]) >= 0.9 * rates[1.0] and conserved
    return Verdict("goodput", "goodput at 2x and 4x >= 90 % of goodput at 1x; work conserved", passed, tuple(lines),
                   tuple(values))


BURST_SEEDS = (21, 41, 61, 81, 101, 121, 141, 161, 181, 201)


def critical_burst(seeds: Sequence[int] = BURST_SEEDS) -> Verdict:
    """Critical P99 TTFT during a sheddable burst at 3x capacity <= 1.2x its P99 unloaded, on each seed
    (a P99 of some sixty requests is their second worst: one seed can pass or fail by luck; seed 21
    alone read 1.13x while ten seeds read 1.13x-1.55x, mean 1.32x); work conserved."""
    cap = capacity_rps(REPLICAS)
    window = (15.0, 45.0)
    slowdowns, busy, pairs = [], [], []
    critical_good = fifo_critical_good = critical_offered = 0
    for seed in seeds:
        critical = mixed(0.15 * cap, DURATION_S, (("vip", "critical", 1.0),), seed=seed)
        burst = mixed(3.0 * cap, 30.0, (("bulk", "sheddable", 1.0),), seed=seed + 1)
        requests = _merge(critical, burst, offsets_s=(0.0, 15.0))
        alone = run(controller, REPLICAS, critical)
        ctl = run(controller, REPLICAS, requests, probes_s=window)
        ref = run(fifo, REPLICAS, requests, probes_s=window)
        unloaded = alone.p99_ttft_s(alone.records("critical", *window))
        slowdowns.append(ctl.p99_ttft_s(ctl.records("critical", *window)) / unloaded)
        critical_offered += len(ctl.records("critical", *window))
        critical_good += ctl.good(ctl.records("critical", *window))
        fifo_critical_good += ref.good(ref.records("critical", *window))
        busy.append(ctl.busy(*window))
        pairs.append((ctl, ref))
    paired = PairedGood.of(pairs)
    passed = max(slowdowns) <= 1.2 and paired.holds and min(busy) >= 0.8
    ctl, ref = pairs[0]
    refusals = [r for ctl, _ in pairs for r in ctl.result.records if r.refused_s is not None]
    at_arrival = sum(1 for r in refusals if r.refused_s == r.arrival_s) / max(1, len(refusals))
    return Verdict("critical_burst", "critical P99 TTFT in a 3x sheddable burst <= 1.2x unloaded, on each seed; "
                   "work conserved", passed,
                   (f"critical P99 TTFT / unloaded over {len(seeds)} seeds: worst {max(slowdowns):.2f}x, mean "
                    f"{float(np.mean(slowdowns)):.2f}x ({' '.join(f'{x:.2f}' for x in slowdowns)}); critical within target {critical_good} "
                    f"of {critical_offered} (FIFO {fifo_critical_good}: it refuses them)", paired.line() + f"; busy >= {min(busy):.1%}",
                    f"refused at arrival: {at_arrival:.0%} of {len(refusals)} refusals (the rest at their "
                    "deadline, as FIFO refuses all)",
                    "first seed: " + _work_line("control", ctl, *window), "first seed: " + _work_line("FIFO", ref, *window)),
                   (("control_slowdown", max(slowdowns)), ("control_mean_slowdown", float(np.mean(slowdowns))),
                    ("critical_good_share", critical_good / critical_offered),
                    ("fifo_critical_good_share", fifo_critical_good / critical_offered), ("control_busy", min(busy)),
                    ("good", float(paired.good)), ("fifo_good", float(paired.fifo_good)), ("noise", paired.noise),
                    ("refused_at_arrival", at_arrival)))


NOISY_SEEDS = (31, 41, 51, 61, 71)


def noisy_tenant(pause_s: float = 0.0) -> Verdict:
    """One tenant at 10x its fair share raises the other tenants' P99 TTFT by < 10 %, on each of five
    seeds: whether the flood is judged before or after its first requests fill the regular level
    changed one seed's figure from 1.3x to 8x, which a single seed cannot show. `pause_s`: the flood
    sends at twice the rate for `pause_s` and pauses as long, the same mean (a pause is not its end:
    a verdict lifted at the pause lets its backlog into the others' headroom)."""
    cap = capacity_rps(REPLICAS)
    window = (15.0, 50.0)
    slowdowns, fifo_slowdowns, busy, lines, pairs = [], [], [], [], []

    def others(run_: ScenarioRun) -> list[RequestRecord]:
        return [r for r in run_.records("standard", *window) if r.tenant != "noisy"]

    for seed in NOISY_SEEDS:
        quiet = mixed(0.6 * cap, DURATION_S, tuple((f"t{i}", "standard", 1.0) for i in range(4)), seed=seed)
        noisy = mixed(1.5 * cap, 40.0, (("noisy", "standard", 1.0),), seed=seed + 1)  # 10x each quiet one's 0.15x
        if pause_s:
            noisy = tuple(r for r in mixed(3.0 * cap, 40.0, (("noisy", "standard", 1.0),), seed=seed + 1)
                          if int(r.arrival_s / pause_s) % 2 == 0)
        requests = _merge(quiet, noisy, offsets_s=(0.0, 10.0))
        alone = run(controller, REPLICAS, quiet)
        ctl = run(controller, REPLICAS, requests, probes_s=window)
        ref = run(fifo, REPLICAS, requests, probes_s=window)
        base = alone.p99_ttft_s(others(alone))
        slowdowns.append(ctl.p99_ttft_s(others(ctl)) / base)
        fifo_slowdowns.append(ref.p99_ttft_s(others(ref)) / base)
        busy.append(ctl.busy(*window))
        pairs.append((ctl, ref))
        lines.append(f"seed {seed}: others' P99 TTFT alone {base * 1000:.0f} ms, beside the flood "
                     f"{slowdowns[-1] * base * 1000:.0f} ms ({slowdowns[-1]:.2f}x); FIFO {fifo_slowdowns[-1]:.2f}x")
    paired = PairedGood.of(pairs)
    lines += [f"worst {max(slowdowns):.2f}x, mean {float(np.mean(slowdowns)):.2f}x; busy >= {min(busy):.1%}", paired.line(),
              "last seed: " + _work_line("control", ctl, *window), "last seed: " + _work_line("FIFO", ref, *window)]
    passed = max(slowdowns) < 1.1 and paired.holds and min(busy) >= 0.8
    return Verdict("noisy_tenant", "others' P99 TTFT with a tenant at 10x its share < 1.1x without it, on each of "
                   f"{len(NOISY_SEEDS)} seeds; work conserved", passed, tuple(lines),
                   (("control_slowdown", max(slowdowns)), ("control_mean_slowdown", float(np.mean(slowdowns))),
                    ("fifo_slowdown", min(fifo_slowdowns)), ("control_busy", min(busy)),
                    ("good", float(paired.good)), ("fifo_good", float(paired.fifo_good)), ("noise", paired.noise)))


def cold_start() -> Verdict:
    """A gateway that has measured nothing yet, at 70 % of capacity from its first second, refuses nothing."""
    requests = mixed(0.7 * capacity_rps(REPLICAS), 30.0, (("a", "standard", 0.8), ("b", "critical", 0.2)), seed=41)
    window = (0.0, 30.0)
    ctl = run(controller, REPLICAS, requests, probes_s=window)
    ref = run(fifo, REPLICAS, requests, probes_s=window)
    first_s = ctl.records(start_s=0.0, end_s=4.0)
    passed = ctl.refused() == 0
    return Verdict("cold_start", "a cold start at 70 % load refuses nothing", passed,
                   (f"refused {ctl.refused()} of {len(requests)} (FIFO {ref.refused()}); first 4 s: "
                    f"P99 TTFT {ctl.p99_ttft_s(first_s) * 1000:.0f} ms",
                    _work_line("control", ctl, *window), _work_line("FIFO", ref, *window)),
                   (("refused", float(ctl.refused())),))


def burst_after_idle() -> Verdict:
    """After a quiet start and a 60 s idle gap, a 3x burst of long prompts (1-3k tokens), 30 % critical:
    critical P99 TTFT within its target from the burst's first second, and critical goodput >= 90 %
    of min(critical offered load, capacity)."""
    quiet = mixed(0.3 * capacity_rps(REPLICAS), 30.0, (("a", "standard", 0.7), ("b", "critical", 0.3)), seed=51)
    long_cap = capacity_rps(REPLICAS, 2000, 144)
    burst_s = 20.0
    burst = mixed(3.0 * long_cap, burst_s, (("a", "standard", 0.7), ("b", "critical", 0.3)), seed=52,
                  prompt=LONG_PROMPT)
    start_s = 90.0
    requests = _merge(quiet, burst, offsets_s=(0.0, start_s))
    window = (start_s, start_s + burst_s)
    ctl = run(controller, REPLICAS, requests, probes_s=window)
    ref = run(fifo, REPLICAS, requests, probes_s=window)
    tiers = default_tiers()
    critical = ctl.records("critical", *window)
    offered_rps = len(critical) / burst_s
    critical_good_rps = ctl.good(critical) / burst_s
    p99 = ctl.p99_ttft_s(critical)
    first = ctl.p99_ttft_s(ctl.records("critical", start_s, start_s + 1.0))
    needed_rps = 0.9 * min(offered_rps, long_cap)
    passed = p99 <= tiers["critical"].ttft_target_s and first <= tiers["critical"].ttft_target_s \
        and critical_good_rps >= needed_rps
    fifo_critical = ref.records("critical", *window)
    return Verdict("burst_after_idle", "long-prompt burst after 60 s idle: critical P99 TTFT <= target from "
                   "the first second; critical goodput >= 90 % of min(offered, capacity)", passed,
                   (f"critical P99 TTFT {p99 * 1000:.0f} ms (first second {first * 1000:.0f} ms; target "
                    f"{tiers['critical'].ttft_target_s * 1000:.0f} ms); FIFO {ref.p99_ttft_s(fifo_critical) * 1000:.0f} ms",
                    f"critical goodput {critical_good_rps:.2f}/s of {offered_rps:.2f}/s offered (capacity "
                    f"{long_cap:.2f}/s, needed {needed_rps:.2f}/s); FIFO {ref.good(fifo_critical) / burst_s:.2f}/s",
                    _work_line("control", ctl, *window), _work_line("FIFO", ref, *window)),
                   (("critical_p99_s", p99), ("critical_goodput_rps", critical_good_rps), ("needed_rps", needed_rps)))


def retry_storm(seeds: Sequence[int] | None = None) -> Verdict:
    """64 and 512 closed-loop clients that resend the same request 20 ms after every refusal (naive
    SDK loops, benchmark tools): requests completed within target during the storm, summed over
    eight seeds, not significantly fewer than FIFO's. Counted by completion, not arrival: clients
    stop at the storm's end, and counting the requests that arrived during it credits whichever arm
    still holds the longer queue then with work done after the storm. Each client's k-th request is
    the same in both arms (`ClosedLoopClients`), so the arms are compared request for request; what
    is left differs at random: at 64 clients neither arm refuses anything and the two still differ
    by up to 4 requests a seed (which request finishes just inside the window), summing to +2 over
    20 seeds. Hence "not significantly fewer": the shortfall of the sum must stay within two
    standard errors of the paired per-seed differences; a systematic loss of even 1 % (14 requests
    over eight seeds of ~175) fails, and the paired differences are printed. The 512 clients run
    twice: with refusals free, and with each refusal's round trip taking `SHARED_CORES_REFUSAL_CPU_S`
    from the replicas' cores (the embedded default, where the gateway and its clients share the
    machine). Refused at once on every resend, the controller answered 309,977 refusals in 20 s
    there (seed 61) and completed 93 requests in time against FIFO's 174, as it lost live
    (bench/retry_storm.py); with rule 10 of `policy.pool` it holds the resends, answers 1,932 and
    completes 193."""
    seeds = STORM_SEEDS if seeds is None else seeds
    duration_s = 20.0
    window = (2.0, duration_s)
    lines, values, passed = [], [], True
    for count, refusal_cpu_s in ((64, 0.0), (512, 0.0), (512, SHARED_CORES_REFUSAL_CPU_S)):
        differences: list[int] = []
        good = fifo_good = sent = fifo_sent = 0
        busy: list[float] = []
        for seed in seeds:
            clients = ClosedLoopClients(count, chat("storm", "standard"), 0.0, duration_s, seed=seed)
            ctl = run(controller, REPLICAS, (), clients=clients, probes_s=window, refusal_cpu_s=refusal_cpu_s)
            ref = run(fifo, REPLICAS, (), clients=clients, probes_s=window, refusal_cpu_s=refusal_cpu_s)
            differences.append(ctl.completed_good(*window) - ref.completed_good(*window))
            good += ctl.completed_good(*window)
            fifo_good += ref.completed_good(*window)
            sent, fifo_sent = sent + len(ctl.result.records), fifo_sent + len(ref.result.records)
            busy.append(ctl.busy(*window))
        # two standard errors of the summed paired difference: sd of one seed's x sqrt(seeds) x 2
        noise = 2.0 * float(np.std(differences, ddof=1)) * len(differences) ** 0.5 if len(differences) > 1 else 0.0
        passed = passed and good >= fifo_good - noise and min(busy) >= 0.8
        case = f"{count}" + ("_shared_cores" if refusal_cpu_s else "")
        lines += [f"{count} clients{', refusals on the replicas cores' if refusal_cpu_s else ''}, {len(seeds)} seeds: "
                  f"completed within target {good} (FIFO {fifo_good}); "
                  f"difference {good - fifo_good:+d}, noise +-{noise:.0f} (per seed {differences}); "
                  f"requests sent {sent} (FIFO {fifo_sent})",
                  "  last seed: " + _work_line("control", ctl, *window), "  last seed: " + _work_line("FIFO", ref, *window)]
        values += [(f"good_{case}", float(good)), (f"fifo_good_{case}", float(fifo_good)),
                   (f"noise_{case}", noise), (f"busy_{case}", min(busy)), (f"sent_{case}", float(sent)),
                   (f"fifo_sent_{case}", float(fifo_sent))]
    return Verdict("retry_storm", "closed-loop retry storm (64, 512 clients): completed within target not "
                   "significantly fewer than FIFO's; replicas busy", passed, tuple(lines), tuple(values))


STORM_SEEDS = (61, 62, 63, 64, 65, 66, 67, 68)
# CPU a refusal's round trip takes from the engines when the gateway, the clients and the engines
# share a machine's cores (the embedded default): bench/retry_storm.py live, 512 clients, 1,770
# refusals a second slowed the engines' generation by 17 % on 2 cores: 0.17 x 2 / 1,770 = 190 us
SHARED_CORES_REFUSAL_CPU_S = 190e-6

SLOWED_AT_S = 20.0


def slowed_replica() -> Verdict:
    """One of two replicas slows 2x (a noisy neighbour, thermal throttling) under 70 % load: the
    controller's fitted TTFT line for it shows it twice as slow per prefill token as the other,
    within +-25 %, no later than 10 s after, and stays so; the replicas stay busy."""
    cap = capacity_rps(REPLICAS)
    requests = mixed(0.7 * cap, 60.0, (("a", "standard", 1.0),), seed=71)
    ids = [f"r{i}" for i in range(REPLICAS)]
    ctl = controller(ids, default_tiers())
    harness = Harness([replica_spec(i) for i in ids], ctl)
    ratios: list[tuple[float, float]] = []

    def sample() -> None:
        slowed, other = ctl.ttft_fit("r0"), ctl.ttft_fit("r1")
        if slowed is not None and other is not None and other.s_per_token > 0:
            ratios.append((harness.loop.now_s - SLOWED_AT_S, slowed.s_per_token / other.s_per_token))

    for second in range(int(SLOWED_AT_S) - 5, 58):
        harness.loop.call_at(float(second), sample)
    result = ScenarioRun(harness.run(requests, (SlowReplica(SLOWED_AT_S, "r0", 2.0),), probes_s=(SLOWED_AT_S, 55.0)),
                         default_tiers())
    # from when on the ratio stays within 2x +-25 % (None: it is outside at the end)
    settled_s: float | None = None
    for t, ratio in ratios:
        if abs(ratio / 2.0 - 1.0) > 0.25:
            settled_s = None
        elif settled_s is None and t >= 0:
            settled_s = t
    busy = result.busy(SLOWED_AT_S, 55.0)
    passed = settled_s is not None and settled_s <= 10.0 and busy >= 0.5
    shown = " ".join(f"{t:+.0f}:{r:.2f}" for t, r in ratios if t % 2 == 0)
    return Verdict("slowed_replica", "a replica slowed 2x: its fitted slope within 2x +-25 % of the other's by 10 s, "
                   "and staying there", passed,
                   (f"slope ratio slowed/other: {shown}; within from "
                    + (f"{settled_s:+.0f} s" if settled_s is not None else "never"),
                    _work_line("control", result, SLOWED_AT_S, 55.0)),
                   (("settled_s", settled_s if settled_s is not None else float("inf")), ("busy", busy),
                    ("ratio_before", float(np.mean([r for t, r in ratios if t < 0]))),
                    ("ratio_from_16s", float(np.mean([r for t, r in ratios if t >= 16])))))


def replica_killed() -> Verdict:
    """One of three replicas dies 20 s into a 70 % load, which leaves the two others at about 105 %:
    the requests it held are lost in both arms, the breaker stops sending it more after a few
    (probes aside), the two left stay busy, critical stays within its target, and at least FIFO's
    requests are served within target."""
    requests = mixed(0.7 * capacity_rps(3), 60.0, (("a", "standard", 0.8), ("b", "critical", 0.2)), seed=81)
    killed_at_s, window = 20.0, (20.0, 50.0)
    events = (KillReplica(killed_at_s, "r0"),)
    ctl = run(controller, 3, requests, events=events, probes_s=window)
    ref = run(fifo, 3, requests, events=events, probes_s=window)

    def sent_to_dead(run_: ScenarioRun) -> int:
        return sum(1 for r in run_.result.records if r.replica_id == "r0" and r.dispatch_s is not None
                   and r.dispatch_s >= killed_at_s)

    def held_when_killed(run_: ScenarioRun) -> int:
        return sum(1 for r in run_.result.records if r.replica_id == "r0" and r.failed_s is not None
                   and r.dispatch_s is not None and r.dispatch_s < killed_at_s)

    tiers = default_tiers()
    critical_p99 = ctl.p99_ttft_s(ctl.records("critical", *window))
    passed = (sent_to_dead(ctl) <= 10 and critical_p99 <= tiers["critical"].ttft_target_s
              and _conserves(ctl, ref, *window))
    return Verdict("replica_killed", "one of three replicas killed at 70 % load: few sent to it after, critical "
                   "within target, work conserved", passed,
                   (f"lost with it: {held_when_killed(ctl)} (FIFO {held_when_killed(ref)}); sent to it after it died: "
                    f"{sent_to_dead(ctl)} (FIFO {sent_to_dead(ref)}); critical P99 TTFT {critical_p99 * 1000:.0f} ms "
                    f"(FIFO {ref.p99_ttft_s(ref.records('critical', *window)) * 1000:.0f} ms)",
                    _work_line("control", ctl, *window), _work_line("FIFO", ref, *window)),
                   (("sent_to_dead", float(sent_to_dead(ctl))), ("critical_p99_s", critical_p99),
                    ("good", float(ctl.good(ctl.records(start_s=window[0], end_s=window[1])))),
                    ("fifo_good", float(ref.good(ref.records(start_s=window[0], end_s=window[1])))),
                    ("busy", ctl.busy(*window))))


PREFIX_TENANTS = 80  # each with its own system prompt of SYSTEM_PROMPT_TOKENS
SYSTEM_PROMPT_TOKENS = 1000
PREFIX_KV_TOKENS = 65536  # a replica's KV cache: half the tenants' prompts and the running sequences


PREFIX_SEEDS = (91, 92, 93, 94, 95, 96)
PREFIX_WINDOW = (5.0, 55.0)  # probes of the busy fraction


def _prefix_run(seed: int) -> tuple[ScenarioRun, ScenarioRun]:
    """(with prefix-aware routing, without) on one seed's arrivals."""
    rng = np.random.default_rng(seed)
    rate = 0.7 * capacity_rps(REPLICAS, SYSTEM_PROMPT_TOKENS + 60, 80)
    offsets = np.cumsum(rng.exponential(1.0 / rate, size=int(rate * 60.0)))
    requests = [SimRequest(i, float(offset), f"t{tenant}", "standard", SYSTEM_PROMPT_TOKENS + int(question),
                           int(output), shared_prefix=int(tenant), shared_prefix_tokens=SYSTEM_PROMPT_TOKENS)
                for i, (offset, tenant, question, output) in enumerate(zip(
                    offsets, rng.integers(PREFIX_TENANTS, size=len(offsets)), rng.integers(20, 100, len(offsets)),
                    rng.integers(32, 128, len(offsets))))]
    ids = [f"r{i}" for i in range(REPLICAS)]
    specs = [replace(replica_spec(i), kv_cache_tokens=PREFIX_KV_TOKENS) for i in ids]

    def arm(settings: PoolSettings) -> ScenarioRun:
        ctl = controller(ids, default_tiers(), settings)
        return ScenarioRun(Harness(specs, ctl).run(requests, probes_s=PREFIX_WINDOW), default_tiers())

    # the index sized as the modelled engines report their KV caches; without affinity
    return arm(PoolSettings()), arm(PoolSettings(prefix_cache_tokens=0))


def prefix_affinity(seeds: Sequence[int] = PREFIX_SEEDS) -> Verdict:
    """Eighty tenants, each with its own 1,000-token system prompt and short questions, at 70 % of what
    two replicas serve with nothing cached. One replica's KV cache holds about half the tenants'
    prompts beside its running sequences: routing decides what stays cached. With prefix-aware
    routing (the controller's rule 7, its index sized like the engine's cache) P50 TTFT is <= 0.6x
    the same controller's without it, as a mean over seeds (without affinity the median sits where
    cached and uncached prompts meet: 61-142 ms from seed to seed), and requests per replica stay
    within 1.5x on every seed."""
    ratios, imbalances, lines = [], [], []

    def p50_s(run_: ScenarioRun) -> float:
        return float(np.percentile([r.ttft_s for r in run_.result.records if r.ttft_s is not None], 50))

    def imbalance(run_: ScenarioRun) -> float:
        counts = [sum(1 for r in run_.result.records if r.replica_id == f"r{i}" and r.served) for i in range(REPLICAS)]
        return max(counts) / max(1, min(counts))

    for seed in seeds:
        affinity, plain = _prefix_run(seed)
        ratios.append(p50_s(affinity) / p50_s(plain))
        imbalances.append(imbalance(affinity))
        lines.append(f"seed {seed}: P50 TTFT {p50_s(affinity) * 1000:.0f} ms with affinity, "
                     f"{p50_s(plain) * 1000:.0f} ms without ({ratios[-1]:.2f}x); P99 "
                     f"{affinity.p99_ttft_s(affinity.records()) * 1000:.0f} vs {plain.p99_ttft_s(plain.records()) * 1000:.0f}"
                     f" ms; imbalance {imbalances[-1]:.2f}x (without {imbalance(plain):.2f}x)")
    mean_ratio = float(np.mean(ratios))
    passed = mean_ratio <= 0.6 and max(imbalances) <= 1.5
    lines.append(f"mean P50 ratio {mean_ratio:.2f}x; worst imbalance {max(imbalances):.2f}x")
    lines += [_work_line("affinity", affinity, *PREFIX_WINDOW), _work_line("without", plain, *PREFIX_WINDOW)]
    return Verdict("prefix_affinity", "80 tenants' long system prompts, about half of them per replica's cache: P50 "
                   "TTFT with prefix-aware routing <= 0.6x without (mean over seeds); requests per replica within "
                   "1.5x", passed, tuple(lines), (("p50_ratio", mean_ratio), ("imbalance", max(imbalances))))


PREFIX_CLIENTS = 4  # bench/prefix_cache.py's closed-loop clients
PREFIX_CLIENT_TENANTS = 8
PREFIX_CLIENT_KV_TOKENS = 5120  # four ~1,060-token prompts and the running sequences' own blocks
PREFIX_CLIENT_SEEDS = (1, 2, 3)
PREFIX_SKEWED_SEEDS = (1, 2, 3, 4)
PREFIX_CLIENT_PROFILE = "tiny-random-llama-cpu"  # the embedded engine the bench runs
# tenants' traffic in a Zipf mix: the busiest tenant sends 37 % of the requests, the quietest 5 %
PREFIX_SKEW = tuple(1.0 / (rank + 1) for rank in range(PREFIX_CLIENT_TENANTS))


def _prefix_clients_run(seed: int, affinity: bool, weights: tuple[float, ...] = (),
                        index_tokens: int | None = None) -> tuple[RunResult, float]:
    """bench/prefix_cache.py's load on the modelled embedded engine, the tenants drawn by `weights`
    (empty: uniformly): (the run, the share of looked-up prompt tokens the engines found cached).
    Without affinity: FIFO's least-loaded routing, the bench's "cache alone". The controller's
    prefix index is sized as the modelled engines report their KV caches, or as `index_tokens`
    configures it."""
    ids = [f"r{i}" for i in range(REPLICAS)]
    profile = load_profile(PREFIX_CLIENT_PROFILE)
    specs = [replace(profile.spec(i), kv_cache_tokens=PREFIX_CLIENT_KV_TOKENS) for i in ids]
    dispatcher: Dispatcher = controller(ids, default_tiers(), kv_cache_tokens=index_tokens) if affinity \
        else fifo(ids, default_tiers())
    question = TrafficClass("shops", "standard", 1.0, LengthDistribution("uniform", 40, 80),
                            LengthDistribution("const", 16, 16))
    clients = ClosedLoopClients(PREFIX_CLIENTS, question, 0.0, 120.0, seed=seed, prefixes=PREFIX_CLIENT_TENANTS,
                                prefix_tokens=SYSTEM_PROMPT_TOKENS, prefix_weights=weights)
    harness = Harness(specs, dispatcher)
    result = harness.run([], clients=clients)
    caches = [replica.scheduler.blocks for replica in harness.replicas.values()]
    hit = sum(c.prefix_hit_tokens for c in caches) / max(1, sum(c.prefix_queried_tokens for c in caches))
    return result, hit


def prefix_clients(seeds: Sequence[int] = PREFIX_CLIENT_SEEDS,
                   skewed_seeds: Sequence[int] = PREFIX_SKEWED_SEEDS) -> Verdict:
    """bench/prefix_cache.py in the simulator: 4 closed-loop clients, 8 tenants each with its own
    1,000-token system prompt, 2 modelled embedded engines whose KV caches hold about half the
    prompts. Tenants drawn uniformly, as the bench does: against caching with least-loaded routing
    (FIFO), prefix-aware routing gives P50 TTFT <= 0.6x, keeps >= 85 % of looked-up prompt tokens
    cached (94 % is every request a hit) and serves at least as many requests. Tenants in a Zipf
    mix (`PREFIX_SKEW`): it still serves at least as many. Both: requests per replica within 1.5x,
    on every seed. It names two of rule 7's parts: `policy.pool.PILE_UP_SLOT_SHARE` (with the cap
    at the least busy replica's count + 1 alone, three requests where their prompts were cached
    sent the fourth away to miss: 67 % cached, as live) and `policy.prefix.AffinityLoad` (without
    moves, the skewed mix split 2.5x between the replicas, one 56 % busy)."""
    lines: list[str] = []
    ratios, hits, imbalances, served = [], [], [], []
    passed = True
    for weights, case_seeds in (((), seeds), (PREFIX_SKEW, skewed_seeds)):
        for seed in case_seeds:
            (aff, aff_hit), (ref, ref_hit) = (_prefix_clients_run(seed, True, weights),
                                              _prefix_clients_run(seed, False, weights))
            p50 = [float(np.percentile([r.ttft_s for r in run_.records if r.ttft_s is not None], 50))
                   for run_ in (aff, ref)]
            counts = [sum(1 for r in aff.records if r.replica_id == f"r{i}" and r.served) for i in range(REPLICAS)]
            done = [sum(1 for r in run_.records if r.served) for run_ in (aff, ref)]
            busy = [stats.busy_s / aff.end_s for stats in aff.replicas]
            imbalances.append(max(counts) / max(1, min(counts)))
            served.append(done[0] / max(1, done[1]))
            passed = passed and done[0] >= done[1] and imbalances[-1] <= 1.5
            if not weights:
                ratios.append(p50[0] / p50[1])
                hits.append(aff_hit)
                passed = passed and ratios[-1] <= 0.6 and aff_hit >= 0.85
            lines.append(f"{'skewed' if weights else 'uniform'} seed {seed}: P50 TTFT {p50[0] * 1000:.0f} ms with "
                         f"affinity, {p50[1] * 1000:.0f} ms cache alone ({p50[0] / p50[1]:.2f}x); prompt tokens "
                         f"cached {aff_hit:.0%} vs {ref_hit:.0%}; served {done[0]} vs {done[1]}; per replica "
                         f"{counts[0]} / {counts[1]} ({imbalances[-1]:.2f}x), busy {busy[0]:.0%} / {busy[1]:.0%}")
    return Verdict("prefix_clients", "bench/prefix_cache.py's 4 clients and 8 tenants on the embedded engine's "
                   "profile: P50 TTFT <= 0.6x cache alone, >= 85 % of prompt tokens cached; with tenants uniform or in a Zipf "
                   "mix, served >= cache alone and requests per replica within 1.5x, every seed", passed, tuple(lines),
                   (("p50_ratio", max(ratios, default=0.0)), ("hit", min(hits, default=1.0)),
                    ("imbalance", max(imbalances)), ("served_ratio", min(served))))


# what the controller's prefix index holds where neither configuration nor engine says (6.4x the engines' caches here)
PREFIX_UNREPORTED_TOKENS = PoolSettings().prefix_cache_tokens


def prefix_index_sizing(seeds: Sequence[int] = PREFIX_CLIENT_SEEDS,
                        skewed_seeds: Sequence[int] = PREFIX_SKEWED_SEEDS) -> Verdict:
    """`prefix_clients`' load with prefix-aware routing, the controller's prefix index sized as the
    modelled engines report their KV caches (5,120 tokens), against the size it takes where none
    reports (`PREFIX_UNREPORTED_TOKENS`). An index larger than its engine's cache believes the
    replica still holds prompts the engine evicted, and sends their tenants there to miss: sized
    from the engines, at least as many prompt tokens are cached on every seed of the bench's
    uniform draw, and as a mean over the Zipf mix's seeds (where moves between replicas also
    decide what stays cached, a seed may go either way: -1.2 to +3.3 points)."""
    lines: list[str] = []
    gains: dict[bool, list[float]] = {False: [], True: []}  # by skewed
    for weights, case_seeds in (((), seeds), (PREFIX_SKEW, skewed_seeds)):
        for seed in case_seeds:
            arms = [_prefix_clients_run(seed, True, weights, index_tokens)
                    for index_tokens in (None, PREFIX_UNREPORTED_TOKENS)]
            (sized, sized_hit), (large, large_hit) = arms
            p50 = [float(np.percentile([r.ttft_s for r in run_.records if r.ttft_s is not None], 50))
                   for run_, _ in arms]
            done = [sum(1 for r in run_.records if r.served) for run_, _ in arms]
            gains[bool(weights)].append(sized_hit - large_hit)
            lines.append(f"{'skewed' if weights else 'uniform'} seed {seed}: prompt tokens cached {sized_hit:.1%} "
                         f"sized from the engines, {large_hit:.1%} at {PREFIX_UNREPORTED_TOKENS:,} tokens; served "
                         f"{done[0]} vs {done[1]}; P50 TTFT {p50[0] * 1000:.0f} vs {p50[1] * 1000:.0f} ms; prefixes "
                         f"moved {sized.prefix_moves} vs {large.prefix_moves}")
    uniform_gain = min(gains[False], default=0.0)
    skewed_gain = float(np.mean(gains[True])) if gains[True] else 0.0
    lines.append(f"cached, sized less oversized: uniform at least {uniform_gain * 100:+.1f} points a seed; "
                 f"Zipf mix {skewed_gain * 100:+.1f} points as a mean")
    return Verdict("prefix_index_sizing", "prefix_clients with the prefix index sized as the engines report their KV "
                   f"caches, against {PREFIX_UNREPORTED_TOKENS:,} tokens: at least as many prompt tokens cached, on "
                   "every uniform seed and as a mean over the Zipf mix's", uniform_gain >= 0 and skewed_gain >= 0,
                   tuple(lines), (("uniform_gain", uniform_gain), ("skewed_gain", skewed_gain)))


SMALL_SLOTS = 2  # sequences one engine runs: bench/chaos.py's mock replicas, a llama.cpp server started with -np 2
SMALL_SEEDS = (91, 92, 93, 94, 95, 96)


def small_engine_replica(replica_id: str) -> PoolReplica:
    """What the live default (`limits.headroom_share` 1/3, `LimitsConfig.pool_replica`) makes of a
    backend's `slot_limit: 2`: one request of a level and better, one of headroom."""
    return PoolReplica(replica_id, max_requests=1, headroom=1)


def small_engines(seeds: Sequence[int] = SMALL_SEEDS) -> Verdict:
    """Replicas whose engines run two sequences (`slot_limit: 2`), one tier at 80 % of their
    capacity: the controller refuses no more than FIFO and serves as many requests within target
    (`PairedGood`). The live default splits such a slot limit into one request of a level and
    better plus one of headroom (`LimitsConfig.pool_replica`); kept for a better tier that never
    comes, the headroom halved the pool: `bench/chaos.py` with overload control refused 36 % of its
    requests at 80 % load."""
    tiers = default_tiers()
    ids = [f"r{i}" for i in range(REPLICAS)]
    specs = [replace(replica_spec(i), scheduler=SchedulerConfig(max_num_seqs=SMALL_SLOTS, max_batch_tokens=512))
             for i in ids]
    cap = REPLICAS * saturated_rps(specs[0], 544, 144, SMALL_SLOTS)
    window = (5.0, 55.0)
    pairs, refused, fifo_refused, busy = [], 0, 0, []
    for seed in seeds:
        requests = mixed(0.8 * cap, DURATION_S, (("a", "standard", 1.0),), seed=seed)
        ctl = PoolController([small_engine_replica(i) for i in ids], tiers, shares=TenantShares())
        ctl_run = ScenarioRun(Harness(specs, ctl).run(requests, probes_s=window), tiers)
        ref_run = ScenarioRun(Harness(specs, FifoDispatcher(ids, tiers, slot_limit=SMALL_SLOTS)).run(
            requests, probes_s=window), tiers)
        pairs.append((ctl_run, ref_run))
        refused += ctl_run.refused()
        fifo_refused += ref_run.refused()
        busy.append(ctl_run.busy(*window))
    paired = PairedGood.of(pairs)
    offered = sum(len(ctl.result.records) for ctl, _ in pairs)
    passed = paired.holds and refused <= fifo_refused + paired.noise
    ctl_run, ref_run = pairs[0]
    return Verdict("small_engines", "engines of two sequences, one tier at 80 % load: refusals no more than "
                   "FIFO's, as many within target", passed,
                   (f"capacity {cap:.2f}/s, offered {0.8 * cap:.2f}/s; refused {refused} of {offered} over "
                    f"{len(seeds)} seeds (FIFO {fifo_refused}); busy >= {min(busy):.1%}", paired.line(),
                    "first seed: " + _work_line("control", ctl_run, *window),
                    "first seed: " + _work_line("FIFO", ref_run, *window)),
                   (("refused", float(refused)), ("fifo_refused", float(fifo_refused)), ("good", float(paired.good)),
                    ("fifo_good", float(paired.fifo_good)), ("noise", paired.noise), ("busy", min(busy))))


SCENARIOS: tuple[Callable[[], Verdict], ...] = (goodput, critical_burst, noisy_tenant, cold_start, burst_after_idle,
                                                retry_storm, slowed_replica, replica_killed, prefix_affinity,
                                                prefix_clients, prefix_index_sizing, small_engines)


def run_all() -> tuple[Verdict, ...]:
    return tuple(scenario() for scenario in SCENARIOS)
