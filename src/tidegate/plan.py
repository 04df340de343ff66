"""Capacity planning: replicas per window of a trace, first by the seeds' formula, then verified and
refined in the simulator until each window meets the SLO. `tidegate plan` prints it.

The formula (the seeds'): replicas = requests per second x time per request / batch / utilisation,
that is the window's arrival rate over what one replica serves saturated at the window's mean
request shape (`sim.capacity.saturated_rps`, behind its slot limit) times a target utilisation.
It ignores queueing under bursts, so each window is then simulated on that many replicas (the
same pool controller `tidegate serve` runs, the profile's cost model) and a replica is added while
the share of requests served within their tier's TTFT target is under the SLO, or taken away
while it still meets it. Windows are planned independently (each starts empty: a backlog carried
from one window into the next is not modelled). Compared with "provision for 2x the peak", the
seeds' rule of thumb: the formula's replicas at twice the busiest window's rate, all the time.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tidegate.sim.capacity import saturated_rps
from tidegate.sim.seam import SimRequest
from tidegate.simulate import Simulation

__all__ = ["WindowPlan", "Plan", "plan_capacity", "read_forecast", "forecast_requests"]


@dataclass(frozen=True, slots=True)
class WindowPlan:
    start_s: float
    rate_rps: float
    formula: int  # the seeds' formula's replicas
    replicas: int  # verified in the simulator
    attainment: float  # share of the window's requests served within their tier's target, on `replicas`
    tried: tuple[tuple[int, float], ...]  # (replicas, attainment) simulated on the way


@dataclass(frozen=True, slots=True)
class Plan:
    windows: tuple[WindowPlan, ...]
    window_s: float
    hours_per_window: float  # real hours a window stands for (the trace's speedup undone)
    slo: float
    static_replicas: int  # "2x the peak"
    price_per_replica_hour: float | None

    @property
    def replica_hours(self) -> float:
        return sum(w.replicas for w in self.windows) * self.hours_per_window

    @property
    def static_replica_hours(self) -> float:
        return self.static_replicas * len(self.windows) * self.hours_per_window

    @property
    def attainment(self) -> float:
        """Over all windows, weighted by their requests."""
        weights = [w.rate_rps for w in self.windows]
        total = sum(weights)
        return sum(w.attainment * weight for w, weight in zip(self.windows, weights)) / total if total else 1.0

    def as_dict(self) -> dict:
        return {"windows": [asdict(w) for w in self.windows], "window_s": self.window_s, "slo": self.slo,
                "hours_per_window": self.hours_per_window, "replica_hours": self.replica_hours,
                "static_replicas": self.static_replicas, "static_replica_hours": self.static_replica_hours,
                "attainment": self.attainment, "price_per_replica_hour": self.price_per_replica_hour}


def _attainment(simulation: Simulation, requests: Sequence[SimRequest]) -> float:
    if not requests:
        return 1.0
    result = simulation.run(requests, probe=False).result
    tiers = simulation.tiers
    good = sum(1 for r in result.records if r.ttft_s is not None and r.finish_s is not None
               and r.ttft_s <= tiers[r.tier].ttft_target_s)
    return good / len(requests)


def plan_capacity(requests: Sequence[SimRequest], *, config: object = None, profile: str = "tiny-random-llama-cpu",
                  windows: int = 12, slo: float = 0.99, target_utilisation: float = 0.8, max_replicas: int = 64,
                  speedup: float = 1.0, price_per_replica_hour: float | None = None) -> Plan:
    """Replicas per window for `requests` (arrival-ordered, times in seconds of the trace as
    replayed), meeting `slo` (share within target) in the simulator."""
    if not requests:
        raise ValueError("no requests to plan for")
    if not 0 < slo <= 1 or not 0 < target_utilisation <= 1 or windows < 1:
        raise ValueError("need 0 < slo <= 1, 0 < target_utilisation <= 1 and windows >= 1")
    span_s = max(r.arrival_s for r in requests) + 1e-9
    window_s = span_s / windows
    probe = Simulation(config, profile=profile, replicas=1)
    spec = probe.profile.spec("r0")
    planned, formulas = [], []
    for index in range(windows):
        start_s = index * window_s
        window = [r for r in requests if start_s <= r.arrival_s < start_s + window_s]
        shifted = tuple(SimRequest(i, r.arrival_s - start_s, r.tenant, r.tier, r.prompt_tokens, r.output_tokens)
                        for i, r in enumerate(window))
        rate = len(window) / window_s
        if window:
            prompt = round(sum(r.prompt_tokens for r in window) / len(window))
            output = max(1, round(sum(r.output_tokens for r in window) / len(window)))
            capacity = saturated_rps(spec, prompt, output, probe.slot_limit)
        else:
            capacity = 1.0
        formula = max(1, math.ceil(rate / (capacity * target_utilisation)))
        formulas.append((rate, capacity))
        tried: dict[int, float] = {}

        def attained(replicas: int) -> float:
            if replicas not in tried:
                tried[replicas] = _attainment(Simulation(config, profile=profile, replicas=replicas), shifted)
            return tried[replicas]

        replicas = min(formula, max_replicas)
        score = attained(replicas)
        while score < slo and replicas < max_replicas:  # refine up: the formula missed queueing
            replicas += 1
            score = attained(replicas)
        while replicas > 1 and score >= slo:  # refine down: the formula's headroom was not needed
            lower = attained(replicas - 1)
            if lower < slo:
                break
            replicas, score = replicas - 1, lower
        planned.append(WindowPlan(start_s, rate, formula, replicas, score, tuple(tried.items())))
    peak_rate, peak_capacity = max(formulas)
    static = max(1, math.ceil(2.0 * peak_rate / (peak_capacity * target_utilisation)))
    return Plan(tuple(planned), window_s, window_s * speedup / 3600.0, slo, static, price_per_replica_hour)


def read_forecast(path: str | Path) -> list[tuple[float, float]]:
    """(start_s, rate_rps) rows of a forecast CSV with those two columns, by start. Each rate holds
    until the next row's start; the last for as long as the row before it (an hour when alone)."""
    rows: list[tuple[float, float]] = []
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        if reader.fieldnames is None or not {"start_s", "rate_rps"} <= set(reader.fieldnames):
            raise ValueError(f"{path}: a forecast needs the columns start_s,rate_rps")
        for line, row in enumerate(reader, start=2):
            try:
                start_s, rate = float(row["start_s"]), float(row["rate_rps"])
            except (TypeError, ValueError):
                raise ValueError(f"{path}:{line}: start_s and rate_rps must be numbers") from None
            if rate < 0 or not math.isfinite(rate) or not math.isfinite(start_s):
                raise ValueError(f"{path}:{line}: rate_rps must be a finite number >= 0")
            rows.append((start_s, rate))
    rows.sort()
    if not rows:
        raise ValueError(f"{path}: the forecast has no rows")
    if any(b[0] <= a[0] for a, b in zip(rows, rows[1:])):
        raise ValueError(f"{path}: two rows share a start_s")
    return rows


def forecast_requests(rows: Sequence[tuple[float, float]], shapes: Sequence[SimRequest], *,
                      seed: int = 0) -> tuple[SimRequest, ...]:
    """Poisson arrivals at each row's rate (times from the first row's start), each request's
    prompt and output lengths drawn from `shapes` (e.g. a trace of the same service): the forecast
    says how many, history says how long."""
    if not shapes:
        raise ValueError("no request shapes to draw lengths from")
    rng = np.random.default_rng(seed)
    origin_s = rows[0][0]
    ends = [start for start, _ in rows[1:]]
    last_length = rows[-1][0] - rows[-2][0] if len(rows) > 1 else 3600.0
    ends.append(rows[-1][0] + last_length)
    arrivals: list[float] = []
    for (start_s, rate), end_s in zip(rows, ends):
        count = rng.poisson(rate * (end_s - start_s))
        arrivals.extend(np.sort(rng.uniform(start_s - origin_s, end_s - origin_s, count)).tolist())
    picks = rng.integers(0, len(shapes), len(arrivals))
    return tuple(SimRequest(i, t, shapes[k].tenant, shapes[k].tier, shapes[k].prompt_tokens, shapes[k].output_tokens)
                 for i, (t, k) in enumerate(zip(arrivals, picks)))
