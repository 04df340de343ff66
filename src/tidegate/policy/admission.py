"""Per-tenant (optionally per-model) RPM and TPM token buckets. Time is an argument.

Follows the token-bucket rate limits of the OpenAI API (requests and tokens per minute, headers
`x-ratelimit-*`) with LiteLLM's reserve-then-settle accounting: admission *reserves* prompt tokens +
max_tokens, completion *settles* to actual usage and refunds the rest. A bucket holds at most one
minute's allowance (burst = limit) and refills continuously at limit / 60 per second.

Invariants (property-tested): a bucket's level stays within [0, capacity]; for every reservation,
reserved - refunded = charged (an overrun beyond the reservation is charged as far as the bucket
allows; a bucket never goes negative, so the rest is forgiven).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

__all__ = [
    "TokenBucket",
    "RateLimit",
    "LimitKind",
    "AdmissionOutcome",
    "Reservation",
    "RateLimitHeaders",
    "AdmissionDecision",
    "Settlement",
    "RateLimiter",
    "ScopeLimit",
    "ScopeDraw",
    "format_reset",
    "scope_label",
    "rate_limited_message",
    "too_large_message",
]


class TokenBucket:
    """A bucket of `capacity` units refilled at `refill_per_s`. Every method takes `now_s`."""

    def __init__(self, capacity: float, refill_per_s: float, now_s: float) -> None:
        if capacity <= 0 or refill_per_s <= 0:
            raise ValueError("capacity and refill_per_s must be > 0")
        self.capacity = float(capacity)
        self.refill_per_s = float(refill_per_s)
        self._level = float(capacity)
        self._updated_s = now_s

    def _refill(self, now_s: float) -> None:
        if now_s > self._updated_s:  # a clock that steps back refills nothing rather than draining
            self._level = min(self.capacity, self._level + (now_s - self._updated_s) * self.refill_per_s)
            self._updated_s = now_s

    def level(self, now_s: float) -> float:
        self._refill(now_s)
        return self._level

    def wait_s(self, now_s: float, amount: float) -> float:
        """Seconds until `amount` can be taken; 0 if now; inf if it exceeds the capacity."""
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self.level(now_s)) / self.refill_per_s)

    def take(self, now_s: float, amount: float) -> bool:
        if amount < 0:
            raise ValueError("amount must be >= 0")
        if self.wait_s(now_s, amount) > 0.0:
            return False
        self._level = max(0.0, self._level - amount)
        return True

    def take_up_to(self, now_s: float, amount: float) -> float:
        """Takes as much of `amount` as the bucket holds; returns what it took."""
        taken = min(amount, self.level(now_s))
        self._level -= taken
        return taken

    def give_back(self, now_s: float, amount: float) -> None:
        if amount < 0:
            raise ValueError("amount must be >= 0")
        self._level = min(self.capacity, self.level(now_s) + amount)

    def full_in_s(self, now_s: float) -> float:
        """Seconds until the bucket is full again: OpenAI's `x-ratelimit-reset-*`."""
        return (self.capacity - self.level(now_s)) / self.refill_per_s


@dataclass(frozen=True, slots=True)
class RateLimit:
    requests_per_minute: int | None = None  # None: no request limit
    tokens_per_minute: int | None = None  # None: no token limit

    def __post_init__(self) -> None:
        for value in (self.requests_per_minute, self.tokens_per_minute):
            if value is not None and value <= 0:
                raise ValueError("a rate limit must be > 0 (or None for no limit)")


class LimitKind(Enum):
    REQUESTS = "requests"
    TOKENS = "tokens"


class AdmissionOutcome(Enum):
    ADMITTED = "admitted"
    RATE_LIMITED = "rate_limited"  # 429 + Retry-After: wait and retry
    TOO_LARGE = "too_large"  # 429 without Retry-After: this request can never fit the token limit


class Reservation(NamedTuple):  # built per request: a NamedTuple is cheap (tidegate.types)
    reservation_id: int
    tenant: str
    model: str
    reserved_tokens: int  # prompt tokens + max_tokens, taken from every token bucket that applies


@dataclass(frozen=True, slots=True)
class RateLimitHeaders:
    """Values of OpenAI's `x-ratelimit-*` response headers, from the most specific limit."""

    limit_requests: int | None
    remaining_requests: int | None
    reset_requests_s: float | None
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_tokens_s: float | None

    def as_http_headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        for kind, limit, remaining, reset_s in (
            ("requests", self.limit_requests, self.remaining_requests, self.reset_requests_s),
            ("tokens", self.limit_tokens, self.remaining_tokens, self.reset_tokens_s),
        ):
            if limit is not None and remaining is not None and reset_s is not None:
                headers[f"x-ratelimit-limit-{kind}"] = str(limit)
                headers[f"x-ratelimit-remaining-{kind}"] = str(remaining)
                headers[f"x-ratelimit-reset-{kind}"] = format_reset(reset_s)
        return headers


class AdmissionDecision(NamedTuple):
    outcome: AdmissionOutcome
    reservation: Reservation | None  # set exactly when admitted; settle it when the request ends
    limit_hit: LimitKind | None  # which limit refused it
    retry_after_s: float | None  # for RATE_LIMITED: when the bucket will hold enough
    headers: RateLimitHeaders | None  # None when no limit applies to this tenant and model
    message: str  # for a refusal: the OpenAI-style error message naming the limit

    @property
    def admitted(self) -> bool:
        return self.outcome is AdmissionOutcome.ADMITTED


class Settlement(NamedTuple):
    reserved_tokens: int
    used_tokens: int
    refunded_tokens: int  # reserved - used when the request used less, else 0
    charged_tokens: float  # reserved - refunded, plus whatever of an overrun the buckets could give


class ScopeLimit(NamedTuple):
    """One limit that applies to a (tenant, model) request: the tenant's (`model` None), then the
    (tenant, model) one. Lets a limiter kept elsewhere (a store shared by several gateways) apply
    exactly the limits this one would."""

    tenant: str
    model: str | None  # None: the tenant's limit over every model
    limit: RateLimit
    label: str  # names the limit in error messages


class ScopeDraw(NamedTuple):
    """What a scope's buckets are below their capacity now: drawn beyond what refill made up."""

    tenant: str
    model: str | None
    requests: float
    tokens: float


def scope_label(tenant: str, model: str | None) -> str:
    return f"tenant {tenant}" + (f", model {model}" if model is not None else "")


def rate_limited_message(kind: LimitKind, label: str, wait_s: float) -> str:
    return f"Rate limit reached for {kind.value} per minute ({label}). Please try again in {format_reset(wait_s)}."


def too_large_message(label: str, cost: int, token_capacity: float) -> str:
    return (f"Request too large for {label}: it needs {cost} tokens (prompt + max_tokens) but the limit is "
            f"{int(token_capacity)} tokens per minute. Reduce the prompt or max_tokens.")


def format_reset(seconds: float) -> str:
    """OpenAI's duration style for reset headers: `20ms`, `1.5s`, `6m0s`."""
    if seconds < 1.0:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    minutes, rest_s = divmod(seconds, 60.0)
    rest = f"{rest_s:.3f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{rest}s" if minutes else f"{rest}s"


@dataclass(slots=True)
class _Scope:
    """The buckets of one (tenant, model-or-all) limit."""

    limit: RateLimit
    requests: TokenBucket | None
    tokens: TokenBucket | None
    label: str  # names the limit in error messages


class RateLimiter:
    """Admits or refuses requests against per-tenant and per-(tenant, model) limits.

    A tenant's limit comes from `tenant_limits`, else `default_limit` (None: unlimited); a
    (tenant, model) limit in `model_limits` applies in addition. A request must fit every limit
    that applies, and is charged to all of them atomically.
    """

    def __init__(
        self,
        tenant_limits: Mapping[str, RateLimit] | None = None,
        *,
        model_limits: Mapping[tuple[str, str], RateLimit] | None = None,
        default_limit: RateLimit | None = None,
    ) -> None:
        self._tenant_limits = dict(tenant_limits or {})
        self._model_limits = dict(model_limits or {})
        self._default_limit = default_limit
        # no limit configured for anyone (the default config): nothing to look up per request
        self._unlimited = not self._tenant_limits and not self._model_limits and default_limit is None
        self._scopes: dict[tuple[str, str | None], _Scope] = {}
        self._open: dict[int, tuple[_Scope, ...]] = {}  # reservation id -> buckets it drew from
        self._ids = itertools.count(1)

    def _scope(self, tenant: str, model: str | None, now_s: float) -> _Scope | None:
        key = (tenant, model)
        scope = self._scopes.get(key)
        if scope is None:
            limit = (self._tenant_limits.get(tenant, self._default_limit) if model is None
                     else self._model_limits.get((tenant, model)))
            if limit is None:
                return None
            rpm, tpm = limit.requests_per_minute, limit.tokens_per_minute
            scope = _Scope(
                limit,
                TokenBucket(rpm, rpm / 60.0, now_s) if rpm else None,
                TokenBucket(tpm, tpm / 60.0, now_s) if tpm else None,
                scope_label(tenant, model),
            )
            self._scopes[key] = scope
        return scope

    def _applicable(self, tenant: str, model: str, now_s: float) -> tuple[_Scope, ...]:
        scopes = (self._scope(tenant, None, now_s), self._scope(tenant, model, now_s))
        return tuple(scope for scope in scopes if scope is not None)

    def admit(self, now_s: float, tenant: str, model: str, prompt_tokens: int, max_tokens: int) -> AdmissionDecision:
        if prompt_tokens < 0 or max_tokens < 0:
            raise ValueError("prompt_tokens and max_tokens must be >= 0")  # a negative cost would mint tokens
        cost = prompt_tokens + max_tokens
        if self._unlimited:  # nothing to charge, nothing to refund: no account kept
            return AdmissionDecision(AdmissionOutcome.ADMITTED, Reservation(0, tenant, model, cost), None, None, None, "")
        scopes = self._applicable(tenant, model, now_s)
        for scope in scopes:
            if scope.tokens is not None and cost > scope.tokens.capacity:
                return self._refuse(AdmissionOutcome.TOO_LARGE, LimitKind.TOKENS, None, scopes, now_s,
                                    too_large_message(scope.label, cost, scope.tokens.capacity))
        worst_wait_s, worst_kind, worst_scope = 0.0, LimitKind.REQUESTS, None
        for scope in scopes:
            for kind, bucket, amount in ((LimitKind.REQUESTS, scope.requests, 1), (LimitKind.TOKENS, scope.tokens, cost)):
                if bucket is not None:
                    wait_s = bucket.wait_s(now_s, amount)
                    if wait_s > worst_wait_s:
                        worst_wait_s, worst_kind, worst_scope = wait_s, kind, scope
        if worst_scope is not None:
            return self._refuse(AdmissionOutcome.RATE_LIMITED, worst_kind, worst_wait_s, scopes, now_s,
                                rate_limited_message(worst_kind, worst_scope.label, worst_wait_s))
        for scope in scopes:
            if scope.requests is not None:
                scope.requests.take(now_s, 1)
            if scope.tokens is not None:
                scope.tokens.take(now_s, cost)
        reservation = Reservation(next(self._ids), tenant, model, cost)
        self._open[reservation.reservation_id] = scopes
        return AdmissionDecision(AdmissionOutcome.ADMITTED, reservation, None, None,
                                 self._headers(scopes, now_s), "")

    def _refuse(self, outcome: AdmissionOutcome, kind: LimitKind, retry_after_s: float | None,
                scopes: tuple[_Scope, ...], now_s: float, message: str) -> AdmissionDecision:
        return AdmissionDecision(outcome, None, kind, retry_after_s, self._headers(scopes, now_s), message)

    def settle(self, now_s: float, reservation: Reservation, used_tokens: int) -> Settlement:
        """Ends a reservation: refunds what the request did not use, charges an overrun.

        Call exactly once per admitted request, with used_tokens = 0 when it never ran (shed,
        expired, cancelled). The request itself stays counted against the request limit.
        """
        if used_tokens < 0:
            raise ValueError("used_tokens must be >= 0")
        scopes = () if self._unlimited else self._open.pop(reservation.reservation_id, None)
        if scopes is None:
            raise ValueError(f"reservation {reservation.reservation_id} is not open (settled twice?)")
        refund = max(0, reservation.reserved_tokens - used_tokens)
        overrun = max(0, used_tokens - reservation.reserved_tokens)
        overrun_charged = float(overrun)
        for scope in scopes:
            if scope.tokens is None:
                continue
            if refund:
                scope.tokens.give_back(now_s, refund)
            if overrun:
                overrun_charged = min(overrun_charged, scope.tokens.take_up_to(now_s, overrun))
        return Settlement(reservation.reserved_tokens, used_tokens, refund,
                          reservation.reserved_tokens - refund + overrun_charged)

    def headers(self, now_s: float, tenant: str, model: str) -> RateLimitHeaders | None:
        return self._headers(self._applicable(tenant, model, now_s), now_s)

    @staticmethod
    def _headers(scopes: tuple[_Scope, ...], now_s: float) -> RateLimitHeaders | None:
        if not scopes:
            return None
        scope = scopes[-1]  # the most specific limit: (tenant, model) when it exists

        def values(bucket: TokenBucket | None) -> tuple[int | None, int | None, float | None]:
            if bucket is None:
                return None, None, None
            return int(bucket.capacity), int(bucket.level(now_s)), bucket.full_in_s(now_s)

        return RateLimitHeaders(*values(scope.requests), *values(scope.tokens))

    @property
    def open_reservations(self) -> int:
        return len(self._open)

    # -- queries for a limiter kept elsewhere (the gateway's shared store): they change no account

    @property
    def unlimited(self) -> bool:
        """No limit is configured for anyone: every request is admitted without an account."""
        return self._unlimited

    def limits_for(self, tenant: str, model: str) -> tuple[ScopeLimit, ...]:
        """The limits a request of `tenant` for `model` must fit, in the order `admit` checks them
        (the tenant's, then the (tenant, model) one); the last one gives the response headers."""
        found: list[ScopeLimit] = []
        tenant_limit = self._tenant_limits.get(tenant, self._default_limit)
        if tenant_limit is not None:
            found.append(ScopeLimit(tenant, None, tenant_limit, scope_label(tenant, None)))
        model_limit = self._model_limits.get((tenant, model))
        if model_limit is not None:
            found.append(ScopeLimit(tenant, model, model_limit, scope_label(tenant, model)))
        return tuple(found)

    def scaled(self, divisor: float) -> RateLimiter:
        """A fresh limiter with every limit divided by `divisor` (each of N gateways enforcing its
        share of a limit on its own). Limits are not rounded: a bucket may hold a fraction."""
        if divisor <= 0:
            raise ValueError("divisor must be > 0")

        def share(limit: RateLimit) -> RateLimit:
            rpm, tpm = limit.requests_per_minute, limit.tokens_per_minute
            return RateLimit(None if rpm is None else rpm / divisor,  # type: ignore[arg-type]
                             None if tpm is None else tpm / divisor)  # type: ignore[arg-type]

        default = None if self._default_limit is None else share(self._default_limit)
        return RateLimiter({name: share(limit) for name, limit in self._tenant_limits.items()},
                           model_limits={key: share(limit) for key, limit in self._model_limits.items()},
                           default_limit=default)

    def drawn(self, now_s: float) -> tuple[ScopeDraw, ...]:
        """Every scope used so far whose buckets are below capacity now, by how much."""
        draws: list[ScopeDraw] = []
        for (tenant, model), scope in self._scopes.items():
            requests = scope.requests.capacity - scope.requests.level(now_s) if scope.requests is not None else 0.0
            tokens = scope.tokens.capacity - scope.tokens.level(now_s) if scope.tokens is not None else 0.0
            if requests > 0 or tokens > 0:
                draws.append(ScopeDraw(tenant, model, requests, tokens))
        return tuple(draws)
