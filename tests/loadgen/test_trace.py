"""Trace parsing, scaling and per-minute counts, on the real Azure trace the package ships."""

from __future__ import annotations

import numpy as np
import pytest

from tidegate.loadgen.trace import default_trace_path, load_azure_trace, parse_azure_trace, per_minute_counts

TRACE_PATH = default_trace_path()

SMALL = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:16:51.2224670,879,55
"""


@pytest.fixture(scope="module")
def trace():
    return load_azure_trace(TRACE_PATH)


def test_parses_seven_digit_fractions_relative_to_the_first_request() -> None:
    trace = parse_azure_trace(SMALL.splitlines())
    assert trace.offsets_s == pytest.approx([0.0, 4.314579, 64.541876], abs=1e-6)
    assert list(trace.context_tokens) == [374, 396, 879]
    assert list(trace.generated_tokens) == [44, 109, 55]


def test_rejects_a_file_that_is_not_an_azure_trace() -> None:
    with pytest.raises(ValueError):
        parse_azure_trace(["time,prompt,output", "1,2,3"])


def test_real_trace_has_its_published_size_and_minute_counts(trace) -> None:
    counts = per_minute_counts(trace.offsets_s)
    assert len(trace) == 19366
    assert counts.sum() == 19366
    assert (len(counts), counts.min(), counts.max()) == (59, 37, 507)


@pytest.mark.parametrize("speedup", [7.0, 60.0])
def test_speedup_keeps_per_minute_counts_exactly(trace, speedup: float) -> None:
    scaled = trace.scaled(np.random.default_rng(0), speedup=speedup)
    assert np.array_equal(per_minute_counts(scaled.offsets_s, 60.0 / speedup), per_minute_counts(trace.offsets_s))


def test_speedup_divides_every_inter_arrival_time(trace) -> None:
    scaled = trace.scaled(np.random.default_rng(0), speedup=60.0)
    assert np.allclose(np.diff(scaled.offsets_s) * 60.0, np.diff(trace.offsets_s))


@pytest.mark.parametrize("rate_scale", [0.3, 2.5])
def test_rate_scale_thins_or_duplicates_by_that_factor(trace, rate_scale: float) -> None:
    scaled = trace.scaled(np.random.default_rng(1), rate_scale=rate_scale)
    assert len(scaled) / len(trace) == pytest.approx(rate_scale, rel=0.03)
    assert np.all(np.diff(scaled.offsets_s) >= 0)


def test_rate_scale_keeps_the_shape_of_the_load(trace) -> None:
    scaled = trace.scaled(np.random.default_rng(2), rate_scale=2.0)
    ratio = per_minute_counts(scaled.offsets_s) / per_minute_counts(trace.offsets_s)
    assert np.median(ratio) == pytest.approx(2.0, rel=0.05)


def test_rate_scale_is_seeded(trace) -> None:
    first = trace.scaled(np.random.default_rng(3), rate_scale=0.5)
    second = trace.scaled(np.random.default_rng(3), rate_scale=0.5)
    assert np.array_equal(first.offsets_s, second.offsets_s)


def test_the_package_ships_the_azure_trace_gzipped_with_its_credit(monkeypatch) -> None:
    monkeypatch.delenv("TIDEGATE_TRACE", raising=False)
    path = default_trace_path()
    assert path.name.endswith(".csv.gz") and path.parent.name == "data"
    assert len(load_azure_trace(path)) == 19_366
    assert "Splitwise" in (path.parent / "README.md").read_text()
