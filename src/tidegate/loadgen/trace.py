"""Trace replay in the Azure LLM inference trace format (`TIMESTAMP,ContextTokens,GeneratedTokens`).

PURE (shared with the simulator): parsing takes text lines, scaling takes a seeded generator.
The bundled real trace is "Azure LLM inference trace 2023, from Patel et al., Splitwise, ISCA 2024"
(CC-BY 4.0); keep that credit wherever a replay of it is reported.
"""

from __future__ import annotations

import datetime as _dt
import gzip
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Iterable

import numpy as np

__all__ = [
    "AZURE_TRACE_CREDIT",
    "Trace",
    "parse_azure_trace",
    "load_azure_trace",
    "default_trace_path",
    "per_minute_counts",
]

AZURE_TRACE_CREDIT = "Azure LLM inference trace 2023, from Patel et al., Splitwise, ISCA 2024"
TRACE_ENV = "TIDEGATE_TRACE"


@dataclass(frozen=True)
class Trace:
    """Arrivals as offsets from the first request, with each request's token counts."""

    offsets_s: np.ndarray  # float64, sorted, offsets_s[0] == 0
    context_tokens: np.ndarray  # int64
    generated_tokens: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.offsets_s)

    def scaled(self, rng: np.random.Generator, speedup: float = 1.0, rate_scale: float = 1.0) -> "Trace":
        """Compress time by `speedup`; thin (<1) or duplicate (>1) requests by `rate_scale`.

        Duplicates are placed uniformly between their original and the next arrival, so the
        shape of the load (per-minute counts x rate_scale) survives without instant bursts.
        """
        if speedup <= 0 or rate_scale <= 0:
            raise ValueError("speedup and rate_scale must be positive")
        offsets, context, generated = self.offsets_s, self.context_tokens, self.generated_tokens
        if rate_scale != 1.0:
            whole = int(np.floor(rate_scale))
            copies = whole + (rng.random(len(offsets)) < (rate_scale - whole)).astype(np.int64)
            index = np.repeat(np.arange(len(offsets)), copies)
            first_copy = np.concatenate(([True], index[1:] != index[:-1])) if len(index) else index.astype(bool)
            gaps = np.diff(offsets, append=offsets[-1] if len(offsets) else 0.0)
            jitter = np.where(first_copy, 0.0, rng.random(len(index)) * gaps[index])
            new_offsets = offsets[index] + jitter
            order = np.argsort(new_offsets, kind="stable")
            offsets, context, generated = new_offsets[order], context[index][order], generated[index][order]
        return Trace(
            offsets_s=offsets / speedup,
            context_tokens=context,
            generated_tokens=generated,
        )


def _day_and_seconds(stamp: str) -> tuple[int, float]:
    # "2023-11-16 18:15:46.6805900": 7 fractional digits, more than datetime parses. Days are kept
    # apart from seconds: days-since-year-1 in seconds would leave float64 only ~10 us of precision.
    date_part, time_part = stamp.strip().split(" ")
    hours, minutes, seconds = time_part.split(":")
    return _dt.date.fromisoformat(date_part).toordinal(), int(hours) * 3600.0 + int(minutes) * 60.0 + float(seconds)


def parse_azure_trace(lines: Iterable[str]) -> Trace:
    rows = iter(lines)
    header = next(rows).strip().split(",")
    if header[:3] != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
        raise ValueError(f"not an Azure LLM trace header: {header}")
    days: list[int] = []
    seconds: list[float] = []
    context: list[int] = []
    generated: list[int] = []
    for line in rows:
        if not line.strip():
            continue
        stamp, ctx, gen = line.strip().split(",")[:3]
        day, second = _day_and_seconds(stamp)
        days.append(day)
        seconds.append(second)
        context.append(int(ctx))
        generated.append(int(gen))
    if not days:
        raise ValueError("trace has no requests")
    day_array = np.asarray(days, dtype=np.int64)
    absolute = (day_array - day_array.min()) * 86400.0 + np.asarray(seconds, dtype=np.float64)
    order = np.argsort(absolute, kind="stable")
    absolute = absolute[order]
    return Trace(
        offsets_s=absolute - absolute[0],
        context_tokens=np.asarray(context, dtype=np.int64)[order],
        generated_tokens=np.asarray(generated, dtype=np.int64)[order],
    )


def load_azure_trace(path: str | os.PathLike[str]) -> Trace:
    """A trace file, plain or gzipped (by its `.gz` suffix)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return parse_azure_trace(handle)


def default_trace_path() -> Path:
    """`$TIDEGATE_TRACE`, else the Azure conversation trace shipped in the package."""
    if os.environ.get(TRACE_ENV):
        return Path(os.environ[TRACE_ENV])
    return Path(str(resources.files("tidegate") / "data" / "azure-llm-2023-conv.csv.gz"))


def per_minute_counts(offsets_s: np.ndarray, minute_s: float = 60.0) -> np.ndarray:
    """Requests per minute counted from the first request; `minute_s` is 60 / speedup for a
    compressed replay (the real trace gives 59 minutes of 37..507 requests)."""
    if len(offsets_s) == 0:
        return np.zeros(0, dtype=np.int64)
    return np.bincount(np.floor(np.asarray(offsets_s) / minute_s).astype(np.int64))
