"""What a fault proxy does to the traffic through it: one `FaultSet`, switched as a whole at run time.

The same document is the YAML of an experiment's proxy step, the JSON of the proxy's admin endpoint and
the flags of `tidegate chaos proxy`, so a fault reads the same wherever it is written. An empty set
(or the word `pass`) forwards everything untouched.

Request-scoped faults (latency per request, reset, stall, error status) count "the response" as the
bytes from the upstream since the latest request on the connection began; that is exact for clients
that wait for an answer before sending the next request (HTTP/1.1 clients, the gateway's upstream
pools), and approximate for pipelining clients.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = [
    "LatencyScope", "LatencyFault", "BandwidthFault", "ResetFault", "StallFault", "ErrorFault", "FaultSet",
    "PASS", "parse_fault_set", "describe_validation_error",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LatencyScope(Enum):
    CONNECTION = "connection"  # once, before the proxy connects upstream
    REQUEST = "request"  # before each request is forwarded (HTTP mode)
    CHUNK = "chunk"  # before each chunk of the response is forwarded


class LatencyFault(_Strict):
    ms: float = Field(gt=0)
    jitter_ms: float = Field(0.0, ge=0)  # each delay drawn uniformly from ms +- jitter_ms, never below 0
    per: tuple[LatencyScope, ...] = (LatencyScope.REQUEST,)

    @model_validator(mode="after")
    def _some_scope(self) -> LatencyFault:
        if not self.per:
            raise ValueError("latency.per names at least one of connection, request, chunk")
        return self


class BandwidthFault(_Strict):
    bytes_per_s: float = Field(gt=0)  # what one connection's client may receive, per second


class ResetFault(_Strict):
    after_bytes: int = Field(0, ge=0)  # of the response; 0: before any byte
    probability: float = Field(1.0, gt=0, le=1)  # per request (per connection in raw TCP mode)


class StallFault(_Strict):
    after_bytes: int = Field(0, ge=0)  # of the response; then nothing more, the connection left open
    probability: float = Field(1.0, gt=0, le=1)


class ErrorFault(_Strict):
    status: int = Field(500, ge=400, le=599)
    probability: float = Field(1.0, gt=0, le=1)
    retry_after_s: int | None = Field(None, ge=0)  # sent as Retry-After, as a 429 or 503 may carry


class FaultSet(_Strict):
    latency: LatencyFault | None = None
    bandwidth: BandwidthFault | None = None
    reset: ResetFault | None = None
    blackhole: bool = False  # accept and read, never answer, never connect upstream
    stall: StallFault | None = None
    error: ErrorFault | None = None
    # request-scoped faults hit only paths starting with one of these (e.g. `/v1/`, sparing the
    # gateway's `/health` checks); empty: every request
    paths: tuple[str, ...] = ()

    def is_pass(self) -> bool:
        return self == PASS

    def matches_path(self, path: bytes) -> bool:
        return not self.paths or any(path.startswith(prefix.encode()) for prefix in self.paths)

    def needs_http(self) -> bool:
        """Whether the set needs request boundaries (unavailable when proxying raw TCP)."""
        per_request = self.latency is not None and LatencyScope.REQUEST in self.latency.per
        return self.error is not None or per_request or bool(self.paths)

    def summary(self) -> str:
        """One line for tables and logs, e.g. `error 500 p=0.3; latency 200±50 ms per request`."""
        parts: list[str] = []
        if self.blackhole:
            parts.append("blackhole")
        if self.latency is not None:
            scopes = "+".join(scope.value for scope in self.latency.per)
            jitter = f"±{self.latency.jitter_ms:g}" if self.latency.jitter_ms else ""
            parts.append(f"latency {self.latency.ms:g}{jitter} ms per {scopes}")
        if self.bandwidth is not None:
            parts.append(f"bandwidth {self.bandwidth.bytes_per_s:g} B/s")
        if self.reset is not None:
            parts.append(f"reset after {self.reset.after_bytes} B p={self.reset.probability:g}")
        if self.stall is not None:
            parts.append(f"stall after {self.stall.after_bytes} B p={self.stall.probability:g}")
        if self.error is not None:
            parts.append(f"error {self.error.status} p={self.error.probability:g}")
        if self.paths and parts:
            parts.append(f"on {','.join(self.paths)}")
        return "; ".join(parts) or "pass"


PASS = FaultSet()


def describe_validation_error(error: ValidationError, source: str) -> str:
    """`source: invalid ...` then one line per problem, named by its dotted location."""
    lines = [f"{source}: invalid"]
    for item in error.errors():
        location = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = "unknown key" if item["type"] == "extra_forbidden" else item["msg"].removeprefix("Value error, ")
        lines.append(f"  {location}: {message}")
    return "\n".join(lines)


def parse_fault_set(data: Any, source: str = "faults") -> FaultSet:
    """A FaultSet from YAML/JSON data; `pass`, null or {} is no fault. Raises ValueError with every problem."""
    if data is None or data == "pass":
        return PASS
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping of faults or `pass`, got {data!r}")
    try:
        return FaultSet.model_validate(data)
    except ValidationError as error:
        raise ValueError(describe_validation_error(error, source)) from None
