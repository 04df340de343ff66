"""W3C traceparent parsing and writing, and the sampling rule (gateway tracing's pure half)."""

from __future__ import annotations

import pytest

from tidegate.telemetry.trace_context import (
    clean_tracestate,
    format_traceparent,
    parse_traceparent,
    sampled_by_ratio,
)

VALID = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_valid_traceparent_is_parsed() -> None:
    parent = parse_traceparent(VALID)
    assert parent is not None
    assert parent.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736
    assert parent.parent_id == 0x00F067AA0BA902B7
    assert parent.sampled


def test_unsampled_flag_is_read() -> None:
    parent = parse_traceparent(VALID[:-2] + b"00")
    assert parent is not None and not parent.sampled


@pytest.mark.parametrize("value", [
    b"",
    b"garbage",
    VALID.upper(),  # the spec's hex is lowercase
    b"ff" + VALID[2:],  # version ff is invalid
    b"00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # all-zero trace id
    b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # all-zero parent id
    VALID + b"-extra",  # version 00 is exactly 55 bytes
    VALID.replace(b"-", b"_"),
    b"00-4bf92f3577b34da6a3ce929d0e0e47-00f067aa0ba902b7-01",  # short trace id
])
def test_invalid_traceparent_is_ignored(value: bytes) -> None:
    assert parse_traceparent(value) is None


def test_later_version_may_carry_more_fields() -> None:
    parent = parse_traceparent(b"01" + VALID[2:] + b"-what-comes-next")
    assert parent is not None and parent.parent_id == 0x00F067AA0BA902B7


def test_format_round_trips() -> None:
    parent = parse_traceparent(VALID)
    assert parent is not None
    assert format_traceparent(parent.trace_id, parent.parent_id, parent.flags) == VALID


def test_tracestate_that_could_break_the_head_is_dropped() -> None:
    assert clean_tracestate(b"congo=t61rcWkgMzE,rojo=00f067aa0ba902b7") == b"congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
    assert clean_tracestate(b"a=b\r\nx-evil: 1") is None
    assert clean_tracestate(b"a=" + b"x" * 600) is None
    assert clean_tracestate(None) is None


def test_ratio_sampling_decides_as_opentelemetry_does() -> None:
    sampling = pytest.importorskip("opentelemetry.sdk.trace.sampling")
    for ratio in (0.0, 0.25, 0.5, 1.0):
        sampler = sampling.TraceIdRatioBased(ratio)
        for trace_id in (1, 2**63, 2**64 - 1, 0x4BF92F3577B34DA6A3CE929D0E0E4736, 0xFFFF_0000_0000_0000_8000_0000_0000_0000):
            expected = sampler.should_sample(None, trace_id, "span").decision.is_sampled()
            assert sampled_by_ratio(trace_id, ratio) == expected, (ratio, hex(trace_id))
