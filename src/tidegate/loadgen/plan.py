"""A run's schedule: which request is sent when, as whom, with how many tokens. PURE."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tidegate.loadgen.arrivals import ArrivalProcess, sample_arrivals
from tidegate.loadgen.mix import LengthDistribution, Tenant, assign_tenants
from tidegate.loadgen.trace import Trace

__all__ = ["PlannedRequest", "TrafficStream", "build_plan", "plan_from_trace"]


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    index: int
    send_at_s: float  # offset from the run's start
    tenant: Tenant
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class TrafficStream:
    """One arrival process feeding a set of tenants; a run superposes one or more streams."""

    arrivals: ArrivalProcess
    tenants: tuple[Tenant, ...]
    prompt_tokens: LengthDistribution
    max_tokens: LengthDistribution


def _finish(times: np.ndarray, tenants: list[Tenant], prompts: np.ndarray, outputs: np.ndarray,
            max_requests: int | None) -> list[PlannedRequest]:
    order = np.argsort(times, kind="stable")
    if max_requests is not None:
        order = order[:max_requests]
    return [
        PlannedRequest(index=i, send_at_s=float(times[j]), tenant=tenants[j],
                       prompt_tokens=int(prompts[j]), max_tokens=int(outputs[j]))
        for i, j in enumerate(order)
    ]


def build_plan(
    streams: Sequence[TrafficStream],
    rng: np.random.Generator,
    duration_s: float | None = None,
    max_requests: int | None = None,
) -> list[PlannedRequest]:
    times: list[np.ndarray] = []
    tenants: list[Tenant] = []
    prompts: list[np.ndarray] = []
    outputs: list[np.ndarray] = []
    for stream in streams:
        offsets = sample_arrivals(stream.arrivals, rng, duration_s, max_requests)
        count = len(offsets)
        times.append(offsets)
        tenants.extend(stream.tenants[k] for k in assign_tenants(rng, stream.tenants, count))
        prompts.append(stream.prompt_tokens.sample(rng, count))
        outputs.append(stream.max_tokens.sample(rng, count))
    return _finish(np.concatenate(times), tenants, np.concatenate(prompts), np.concatenate(outputs),
                   max_requests)


def plan_from_trace(
    trace: Trace,
    tenants: Sequence[Tenant],
    rng: np.random.Generator,
    duration_s: float | None = None,
    max_requests: int | None = None,
    prompt_tokens: LengthDistribution | None = None,
    max_tokens: LengthDistribution | None = None,
) -> list[PlannedRequest]:
    """Replays an (already scaled) trace; token counts come from the trace unless overridden."""
    offsets = trace.offsets_s
    if duration_s is not None:
        offsets = offsets[offsets < duration_s]
    count = len(offsets)
    chosen = [tenants[k] for k in assign_tenants(rng, tenants, count)]
    prompts = prompt_tokens.sample(rng, count) if prompt_tokens else np.maximum(trace.context_tokens[:count], 1)
    outputs = max_tokens.sample(rng, count) if max_tokens else np.maximum(trace.generated_tokens[:count], 1)
    return _finish(offsets, chosen, prompts, outputs, max_requests)
