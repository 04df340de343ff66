"""W3C Trace Context (https://www.w3.org/TR/trace-context/): `traceparent` parsed and written, the
sampling decision, and new ids. Pure: no clock, no I/O, no OpenTelemetry import.

traceparent: `{version:2}-{trace-id:32}-{parent-id:16}-{flags:2}`, lowercase hex; an all-zero trace
or parent id, version `ff`, or anything malformed makes the header invalid, and an invalid header is
ignored as if absent (the spec's rule: a new trace starts).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["TraceParent", "parse_traceparent", "clean_tracestate", "format_traceparent", "sampled_by_ratio",
           "new_trace_id", "new_span_id", "new_span_base", "random_bits", "FLAG_SAMPLED"]

FLAG_SAMPLED = 0x01
_HEX = frozenset(b"0123456789abcdef")
_MAX_TRACESTATE_BYTES = 512  # the spec lets a vendor drop a longer one rather than truncate it badly
_RANDOM = random.Random()  # OpenTelemetry's own id generator draws from `random` too: ids need no crypto
random_bits = _RANDOM.getrandbits  # where ids come from, for a caller that draws its own


@dataclass(frozen=True, slots=True)
class TraceParent:
    trace_id: int  # 128 bits, never 0
    parent_id: int  # 64 bits: the caller's span, never 0
    flags: int  # 8 bits; FLAG_SAMPLED: the caller records this trace

    @property
    def sampled(self) -> bool:
        return bool(self.flags & FLAG_SAMPLED)


def _is_hex(value: bytes) -> bool:
    return all(byte in _HEX for byte in value)


def parse_traceparent(value: bytes | None) -> TraceParent | None:
    """The header's fields, or None when it is absent or invalid."""
    if value is None:
        return None
    value = value.strip(b" \t")
    if len(value) < 55 or value[2:3] != b"-" or value[35:36] != b"-" or value[52:53] != b"-":
        return None
    version = value[:2]
    if not _is_hex(version) or version == b"ff":
        return None
    # version 00 is exactly 55 bytes; a later version may append fields after a '-', which we ignore
    if (version == b"00" and len(value) != 55) or (len(value) > 55 and value[55:56] != b"-"):
        return None
    trace_hex, parent_hex, flags_hex = value[3:35], value[36:52], value[53:55]
    if not (_is_hex(trace_hex) and _is_hex(parent_hex) and _is_hex(flags_hex)):
        return None
    trace_id, parent_id = int(trace_hex, 16), int(parent_hex, 16)
    if trace_id == 0 or parent_id == 0:
        return None
    return TraceParent(trace_id, parent_id, int(flags_hex, 16))


def clean_tracestate(value: bytes | None) -> bytes | None:
    """The client's `tracestate`, passed on as it came; dropped when too long or not printable ASCII
    (it is written into the upstream request's head)."""
    if not value or len(value) > _MAX_TRACESTATE_BYTES:
        return None
    if any(byte < 0x20 or byte > 0x7e for byte in value):
        return None
    return value.strip(b" \t") or None


def format_traceparent(trace_id: int, span_id: int, flags: int) -> bytes:
    return b"00-%032x-%016x-%02x" % (trace_id, span_id, flags)


def sampled_by_ratio(trace_id: int, ratio: float) -> bool:
    """OpenTelemetry's TraceIdRatioBased rule: the trace id's low 64 bits under ratio x 2^64, so that
    every process deciding on the same trace id with the same ratio decides alike."""
    return (trace_id & 0xFFFF_FFFF_FFFF_FFFF) < round(ratio * 2**64)


def new_trace_id() -> int:
    return _RANDOM.getrandbits(128) or 1


def new_span_id() -> int:
    return _RANDOM.getrandbits(64) or 1


def new_span_base() -> bytes:
    """7 random bytes: a request's span ids are these and a byte that names the span (gateway/tracing.py)."""
    return _RANDOM.getrandbits(56).to_bytes(7, "big")
