"""Per-tenant RPM/TPM limits shared by several gateway processes, kept in Redis (`shared_state`).

With `shared_state.backend: redis` a tenant's request and token buckets live in one Redis hash per
limit scope (the tenant's, and a (tenant, model) one where configured) instead of in each process,
so N gateways admit a tenant's limit once, not N times (LiteLLM's limit x replicas). The buckets
are `policy.admission.TokenBucket`s, with the same reserve -> settle accounting, headers and
Retry-After as the in-process `RateLimiter`, computed by two Lua scripts that Redis runs atomically:

- ADMIT reads Redis `TIME` (the gateways' clocks, and their skew, play no part), refills every
  bucket that applies, refuses a request larger than a token limit can ever hold, else admits only
  if every bucket holds enough, charging all of them or none (1 request, prompt + max_tokens
  tokens), and returns the outcome, the wait (Retry-After) and the `x-ratelimit-*` values;
- ADJUST settles: gives back the unused reservation (never past capacity) or takes an overrun
  (never below zero); the same script takes a fallback period's local draw on reconnection.

The hot path. An admission must wait for Redis: the decision is the global state's. It costs one
loopback round trip (+0.11 ms at p50 in bench/shared_limits.py, against a model's hundreds of ms to
first token), and never waits behind another request: one connection is pipelined, commands written
in one batch per event-loop turn and replies matched in order. CPU is what a gateway runs out of
first, and three choices keep it within 1.3x of the in-process buckets (measured by the bench, 3
gateways at 300 requests/s on 2 cores; see docs/scale-out.md):
- the client is a small RESP2 protocol on the event loop, not redis-py: EVALSHA on loopback, 16 in
  flight, costs ~8 us of CPU here and ~35 us through redis-py's asyncio client;
- settlement never waits, and lingers up to 10 ms to be written with the next admission, so that
  its reply arrives in the same read: a wake-up of the gateway costs more than the command;
- while Redis has just said a tenant's request bucket is empty for w seconds, the gateway refuses
  that tenant itself for w seconds: exact, since request buckets gain only by refill, never by a
  refund (token buckets can gain from another gateway's refund at any time, so they are not).
With the last two off the bench measured 1.47x the memory backend's CPU per request; with them,
1.16x. No local lease is taken: a lease strands its unused part with one process and breaks
exactness, which is what the scripts buy.

Redis unreachable, failing or slower than `redis_timeout_s` (`on_redis_error`): `local` admits on
in-process buckets of limit / `gateway_count` (`RateLimiter.scaled`), `fail_open` admits, and
`fail_closed` answers 503 + Retry-After. One log line per outage, `tidegate_shared_state_redis_up`
and `tidegate_shared_state_errors_total{op}`. Redis is tried again every `redis_retry_s`; on its
return the scripts are loaded again, refunds that could not be sent are sent, what the local buckets
admitted beyond their refill is charged to Redis (`local` mode), and new reservations go to Redis.
A command written to a connection that then breaks is not sent again: a lost refund over-charges a
tenant a little; a repeated charge would be worse, and a repeated refund could over-admit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from tidegate.errors import OverloadedError
from tidegate.gateway.resp import RespConnection, RespError, bulk, encode_command, register_script
from tidegate.policy.admission import (
    AdmissionDecision,
    AdmissionOutcome,
    LimitKind,
    RateLimiter,
    RateLimitHeaders,
    Reservation,
    ScopeLimit,
    rate_limited_message,
    too_large_message,
)

__all__ = [
    "ADMIT_SCRIPT",
    "ADJUST_SCRIPT",
    "SharedLimitSettings",
    "SharedStateMetrics",
    "SharedAdmission",
    "SharedLimits",
]

log = logging.getLogger("tidegate.shared_limits")

# Both scripts: KEYS[i] is one limit scope's hash {r: request level, t: token level, u: when they
# were last brought up to date, in Redis time (s)}; a missing hash is a full bucket (keys expire
# once they would be full again). ARGV[1] is now in seconds, '' for Redis TIME (only tests pass a
# time); ARGV[2i], ARGV[2i+1] the scope's requests and tokens per minute (0: no such limit).
_LOAD = """
local now
if ARGV[1] == '' then
  local clock = redis.call('TIME')
  now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
else
  now = tonumber(ARGV[1])
end
local n = #KEYS
local rc, tc, r, t, u = {}, {}, {}, {}, {}
local function fmt(x) return string.format('%.17g', x) end
local function load(i, h)
  rc[i] = tonumber(ARGV[2 * i]); tc[i] = tonumber(ARGV[2 * i + 1])
  local ri, ti, ui = tonumber(h[1]) or rc[i], tonumber(h[2]) or tc[i], tonumber(h[3]) or now
  if now > ui then  -- a clock stepping back refills nothing rather than draining
    ri = ri + (now - ui) * rc[i] / 60
    ti = ti + (now - ui) * tc[i] / 60
    ui = now
  end
  r[i] = math.min(ri, rc[i]); t[i] = math.min(ti, tc[i]); u[i] = ui
end
local function save(i)
  local fields, full_s = {'u', fmt(u[i])}, 0
  if rc[i] > 0 then
    fields[#fields + 1] = 'r'; fields[#fields + 1] = fmt(r[i])
    full_s = math.max(full_s, (rc[i] - r[i]) * 60 / rc[i])
  end
  if tc[i] > 0 then
    fields[#fields + 1] = 't'; fields[#fields + 1] = fmt(t[i])
    full_s = math.max(full_s, (tc[i] - t[i]) * 60 / tc[i])
  end
  redis.call('HSET', KEYS[i], unpack(fields))
  redis.call('PEXPIRE', KEYS[i], math.ceil(full_s * 1000) + 1000)
end
"""

# ARGV[2n+2]: the request's cost, prompt tokens + max_tokens. Returns "outcome kind wait scope" and
# the last (most specific) scope's "limit remaining reset" for requests, then tokens ('-' where it
# has no such limit): outcome 0 admitted, 1 rate limited (kind r|t, wait s, scope 1-based), 2 too large.
ADMIT_SCRIPT = _LOAD + """
local cost = tonumber(ARGV[2 * n + 2])
for i = 1, n do load(i, redis.call('HMGET', KEYS[i], 'r', 't', 'u')) end
local function answer(head)
  local out = head
  if rc[n] > 0 then
    out = out .. ' ' .. fmt(rc[n]) .. ' ' .. fmt(math.floor(r[n])) .. ' ' .. fmt((rc[n] - r[n]) * 60 / rc[n])
  else
    out = out .. ' - - -'
  end
  if tc[n] > 0 then
    out = out .. ' ' .. fmt(tc[n]) .. ' ' .. fmt(math.floor(t[n])) .. ' ' .. fmt((tc[n] - t[n]) * 60 / tc[n])
  else
    out = out .. ' - - -'
  end
  return out
end
for i = 1, n do
  if tc[i] > 0 and cost > tc[i] then return answer('2 t - ' .. i) end
end
local wait, kind, scope = 0, '-', 0
for i = 1, n do
  if rc[i] > 0 then
    local w = math.huge
    if rc[i] >= 1 then w = math.max(0, (1 - r[i]) * 60 / rc[i]) end
    if w > wait then wait, kind, scope = w, 'r', i end
  end
  if tc[i] > 0 then
    local w = math.max(0, (cost - t[i]) * 60 / tc[i])
    if w > wait then wait, kind, scope = w, 't', i end
  end
end
if scope > 0 then return answer('1 ' .. kind .. ' ' .. fmt(wait) .. ' ' .. scope) end
for i = 1, n do
  if rc[i] > 0 then r[i] = math.max(0, r[i] - 1) end
  if tc[i] > 0 then t[i] = math.max(0, t[i] - cost) end
  save(i)
end
return answer('0 - 0 0')
"""

# ARGV[2n+2]: requests to take, up to what each bucket holds; ARGV[2n+3]: tokens to give back, up
# to capacity; ARGV[2n+4]: tokens to take, up to what each bucket holds. Returns the tokens of the
# last that every bucket could give (the least of them).
ADJUST_SCRIPT = _LOAD + """
local take_r, give_t, take_t = tonumber(ARGV[2 * n + 2]), tonumber(ARGV[2 * n + 3]), tonumber(ARGV[2 * n + 4])
local charged = take_t
for i = 1, n do
  local h = redis.call('HMGET', KEYS[i], 'r', 't', 'u')
  -- a missing hash is a full bucket: giving back changes nothing
  if h[3] or take_r > 0 or take_t > 0 then
    load(i, h)
    if rc[i] > 0 and take_r > 0 then r[i] = r[i] - math.min(r[i], take_r) end
    if tc[i] > 0 then
      if give_t > 0 then t[i] = math.min(tc[i], t[i] + give_t) end
      if take_t > 0 then
        local took = math.min(t[i], take_t)
        t[i] = t[i] - took
        charged = math.min(charged, took)
      end
    end
    save(i)
  end
end
return fmt(charged)
"""

_ADMIT_SHA = register_script(ADMIT_SCRIPT)
_ADJUST_SHA = register_script(ADJUST_SCRIPT)


class SharedLimitSettings:
    """`shared_state` of the config, for the gateway."""

    __slots__ = ("redis_url", "on_redis_error", "gateway_count", "redis_timeout_s", "redis_retry_s", "key_prefix")

    def __init__(self, redis_url: str, on_redis_error: str = "local", gateway_count: int = 1,
                 redis_timeout_s: float = 0.25, redis_retry_s: float = 1.0, key_prefix: str = "tidegate:rl:") -> None:
        if on_redis_error not in ("fail_open", "fail_closed", "local"):
            raise ValueError(f"on_redis_error: {on_redis_error!r}")
        self.redis_url = redis_url
        self.on_redis_error = on_redis_error
        self.gateway_count = gateway_count
        self.redis_timeout_s = redis_timeout_s
        self.redis_retry_s = redis_retry_s
        self.key_prefix = key_prefix


class SharedStateMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.redis_up = Gauge("tidegate_shared_state_redis_up", "1 while the shared rate limits are decided in "
                              "Redis; 0 while on_redis_error decides", registry=registry)
        self.errors = Counter("tidegate_shared_state_errors", "Failed, refused or slow Redis operations of the "
                              "shared rate limits (connect, admit, settle, reconcile)", ["op"], registry=registry)
        self.fallback = Counter("tidegate_shared_state_fallback_admissions", "Admissions decided without Redis, "
                                "by on_redis_error mode", ["mode"], registry=registry)
        self.local_refusals = Counter("tidegate_shared_state_local_refusals", "Requests refused without asking "
                                      "Redis: their request bucket is known to be empty a while yet",
                                      registry=registry)


class _Spec:
    """One (tenant, model): the limit scopes that apply and its commands, encoded once, and what
    the last refusal for lack of a request taught (`empty_*`)."""

    __slots__ = ("tenant", "model", "scopes", "keys", "limits", "admit_prefix", "adjust_prefix", "empty_until_s",
                 "empty_since_s", "empty_scope", "empty_headers")

    def __init__(self, tenant: str, model: str, scopes: tuple[ScopeLimit, ...], key_prefix: str) -> None:
        self.tenant = tenant
        self.model = model
        self.scopes = scopes
        # one hash tag per tenant: a tenant's scopes sit in one Redis Cluster slot, as a script needs
        self.keys = tuple(f"{key_prefix}{{{s.tenant}}}".encode() + (b":" + s.model.encode() if s.model else b"")
                          for s in scopes)
        self.limits = tuple(b"%.17g" % float(limit or 0) for s in scopes
                            for limit in (s.limit.requests_per_minute, s.limit.tokens_per_minute))
        self.admit_prefix = self._prefix(_ADMIT_SHA, 1, b"")
        self.adjust_prefix = self._prefix(_ADJUST_SHA, 3, b"")
        # a request bucket Redis found short of one request: until this (gateway clock) none can be
        # admitted by any gateway (request buckets gain only by refill, never by refunds)
        self.empty_until_s = 0.0
        self.empty_since_s = 0.0
        self.empty_scope: ScopeLimit | None = None
        self.empty_headers: RateLimitHeaders | None = None

    def _prefix(self, sha: bytes, tail: int, now: bytes) -> bytes:
        """The command up to its last `tail` arguments (which the caller appends as bulk strings)."""
        parts = (b"EVALSHA", sha, b"%d" % len(self.keys), *self.keys, now, *self.limits)
        return b"*%d\r\n" % (len(parts) + tail) + b"".join(bulk(part) for part in parts)

    def admit(self, cost: int, now: bytes = b"") -> bytes:
        prefix = self.admit_prefix if not now else self._prefix(_ADMIT_SHA, 1, now)
        return prefix + bulk(b"%d" % cost)

    def adjust(self, take_requests: float, give_tokens: float, take_tokens: float, now: bytes = b"") -> bytes:
        prefix = self.adjust_prefix if not now else self._prefix(_ADJUST_SHA, 3, now)
        return prefix + b"".join(bulk(b"%.17g" % float(x)) for x in (take_requests, give_tokens, take_tokens))


def _int(field: bytes) -> int | None:
    return None if field == b"-" else int(float(field))


def _float(field: bytes) -> float | None:
    return None if field == b"-" else float(field)


class SharedAdmission:
    """One request's admission by the shared limits: `decision` for the overload control, and
    `settle(used_tokens)` once the request has ended (exactly once; a refusal's is a no-op)."""

    __slots__ = ("decision", "prompt_tokens", "max_tokens", "_owner", "_spec", "_local")

    def __init__(self, decision: AdmissionDecision, prompt_tokens: int, max_tokens: int,
                 owner: SharedLimits | None = None, spec: _Spec | None = None,
                 local: RateLimiter | None = None) -> None:
        self.decision = decision
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self._owner = owner  # None: nothing to settle (refused, no limit, admitted open)
        self._spec = spec
        self._local = local  # the in-process limiter that admitted it during an outage

    def settle(self, used_tokens: int) -> None:
        owner, self._owner = self._owner, None
        if owner is None or self.decision.reservation is None:
            return
        owner._settle(self, used_tokens)


class SharedLimits:
    """The rate-limit decision of a gateway whose limits live in Redis: `await admit(...)` per
    request, `SharedAdmission.settle` when it ends; `start`/`close` with the gateway."""

    def __init__(self, settings: SharedLimitSettings, limiter: RateLimiter, registry: CollectorRegistry,
                 clock: Callable[[], float] = time.monotonic, redis_now: Callable[[], float] | None = None,
                 *, local_refusals: bool = True) -> None:
        self.settings = settings
        # refuse without a round trip while a request bucket is known to be empty (exact: see _Spec)
        self._local_refusals = local_refusals
        self._limiter = limiter  # the configured limits (decides nothing here but in `local` fallback)
        self._local = limiter.scaled(settings.gateway_count)
        self._local_used = False  # the local buckets admitted something since the last reconciliation
        self.metrics = SharedStateMetrics(registry)
        self._clock = clock
        self._redis_now = redis_now  # tests only: a time for the scripts instead of Redis TIME
        self._specs: dict[tuple[str, str], _Spec | None] = {}
        self._conn: RespConnection | None = None
        self._connecting: asyncio.Task | None = None
        self._retry_at_s = 0.0
        self._in_outage = False
        self._closed = False
        self._unsent: deque[tuple[_Spec, float, float]] = deque(maxlen=100_000)  # settlements for Redis's return
        self._last_error_log_s = -1e9

    # -- lifecycle
    async def start(self) -> None:
        """Connects (a Redis down at start is an outage: the gateway starts and serves anyway)."""
        self._connecting = asyncio.get_running_loop().create_task(self._connect())
        await self._connecting

    async def close(self) -> None:
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()  # the settlements still lingering are written first

    @property
    def redis_up(self) -> bool:
        return self._conn is not None

    async def barrier(self) -> None:
        """Returns once Redis has run every command sent before (tests, benches)."""
        conn = self._conn
        if conn is not None:
            await conn.call(encode_command(b"PING"))

    # -- the request path
    async def admit(self, tenant: str, model: str, prompt_tokens: int, max_tokens: int) -> SharedAdmission:
        """The shared limits' decision; raises OverloadedError (503) in `fail_closed` during an outage."""
        try:
            spec = self._specs[(tenant, model)]
        except KeyError:
            spec = self._spec(tenant, model)
        cost = prompt_tokens + max_tokens
        if spec is None:  # no limit applies to this tenant and model: no account kept
            return SharedAdmission(AdmissionDecision(AdmissionOutcome.ADMITTED, Reservation(0, tenant, model, cost),
                                                     None, None, None, ""), prompt_tokens, max_tokens)
        conn = self._conn
        if conn is not None:
            sent_s = self._clock()
            if spec.empty_until_s > sent_s and self._local_refusals:
                return self._refused_here(spec, sent_s, prompt_tokens, max_tokens)
            now = b"" if self._redis_now is None else b"%.17g" % self._redis_now()
            try:
                reply = await conn.call(spec.admit(cost, now), (spec, cost))
            except RespError as error:  # Redis answered, but not with a decision: this one falls back
                self._reply_error("admit", error)
            except (OSError, TimeoutError):
                pass  # the connection broke: `_lost` has counted it and falls back from now on
            else:
                return self._decided(spec, reply, cost, prompt_tokens, max_tokens, sent_s)
        else:
            self._reconnect()
        return self._fallback(spec, cost, prompt_tokens, max_tokens)

    def _spec(self, tenant: str, model: str) -> _Spec | None:
        scopes = self._limiter.limits_for(tenant, model)
        spec = _Spec(tenant, model, scopes, self.settings.key_prefix) if scopes else None
        self._specs[(tenant, model)] = spec
        return spec

    def _decided(self, spec: _Spec, reply: bytes, cost: int, prompt_tokens: int, max_tokens: int,
                 sent_s: float) -> SharedAdmission:
        fields = reply.split()
        headers = RateLimitHeaders(_int(fields[4]), _int(fields[5]), _float(fields[6]),
                                   _int(fields[7]), _int(fields[8]), _float(fields[9]))
        outcome = fields[0]
        if outcome == b"0":
            decision = AdmissionDecision(AdmissionOutcome.ADMITTED, Reservation(0, spec.tenant, spec.model, cost),
                                         None, None, headers, "")
            return SharedAdmission(decision, prompt_tokens, max_tokens, self, spec)
        scope = spec.scopes[int(fields[3]) - 1]
        if outcome == b"2":
            decision = AdmissionDecision(AdmissionOutcome.TOO_LARGE, None, LimitKind.TOKENS, None, headers,
                                         too_large_message(scope.label, cost, scope.limit.tokens_per_minute or 0))
        else:
            kind = LimitKind.REQUESTS if fields[1] == b"r" else LimitKind.TOKENS
            wait_s = float(fields[2])
            decision = AdmissionDecision(AdmissionOutcome.RATE_LIMITED, None, kind, wait_s, headers,
                                         rate_limited_message(kind, scope.label, wait_s))
            if kind is LimitKind.REQUESTS:
                # Redis ran the script after `sent_s`: the bucket holds no request before sent_s + wait_s.
                # (A token bucket may gain sooner, by another gateway's refund: not remembered.)
                spec.empty_until_s, spec.empty_since_s = sent_s + wait_s, sent_s
                spec.empty_scope, spec.empty_headers = scope, headers
        return SharedAdmission(decision, prompt_tokens, max_tokens)

    def _refused_here(self, spec: _Spec, now_s: float, prompt_tokens: int, max_tokens: int) -> SharedAdmission:
        """A refusal without a round trip: the request bucket is known to be empty until
        `empty_until_s`. The headers are Redis's last ones, their resets aged."""
        wait_s = spec.empty_until_s - now_s
        aged = now_s - spec.empty_since_s
        last = spec.empty_headers
        assert last is not None and spec.empty_scope is not None
        headers = RateLimitHeaders(
            last.limit_requests, last.remaining_requests,
            None if last.reset_requests_s is None else max(0.0, last.reset_requests_s - aged),
            last.limit_tokens, last.remaining_tokens,
            None if last.reset_tokens_s is None else max(0.0, last.reset_tokens_s - aged))
        self.metrics.local_refusals.inc()
        return SharedAdmission(AdmissionDecision(AdmissionOutcome.RATE_LIMITED, None, LimitKind.REQUESTS, wait_s,
                                                 headers, rate_limited_message(LimitKind.REQUESTS,
                                                                               spec.empty_scope.label, wait_s)),
                               prompt_tokens, max_tokens)

    def _fallback(self, spec: _Spec, cost: int, prompt_tokens: int, max_tokens: int) -> SharedAdmission:
        mode = self.settings.on_redis_error
        self.metrics.fallback.labels(mode).inc()
        if mode == "local":
            self._local_used = True
            local = self._local
            decision = local.admit(self._clock(), spec.tenant, spec.model, prompt_tokens, max_tokens)
            return SharedAdmission(decision, prompt_tokens, max_tokens, self, spec, local)
        if mode == "fail_open":
            return SharedAdmission(AdmissionDecision(AdmissionOutcome.ADMITTED,
                                                     Reservation(0, spec.tenant, spec.model, cost), None, None,
                                                     None, ""), prompt_tokens, max_tokens)
        retry_s = max(1.0, self.settings.redis_retry_s)
        raise OverloadedError("rate limits are unavailable (their shared store does not answer); retry later",
                              code="rate_limits_unavailable", retry_after_s=retry_s)

    def _settle(self, admission: SharedAdmission, used_tokens: int) -> None:
        reservation = admission.decision.reservation
        assert reservation is not None and admission._spec is not None
        local = admission._local
        if local is not None:
            local.settle(self._clock(), reservation, used_tokens)
            if local is self._local:
                return
            # admitted locally, then charged to Redis whole when it returned: settle it there too
        reserved = reservation.reserved_tokens
        give, take = max(0, reserved - used_tokens), max(0, used_tokens - reserved)
        if give or take:
            self._adjust(admission._spec, give, take)

    def _adjust(self, spec: _Spec, give_tokens: float, take_tokens: float) -> None:
        conn = self._conn
        if conn is not None:
            now = b"" if self._redis_now is None else b"%.17g" % self._redis_now()
            if conn.send(spec.adjust(0, give_tokens, take_tokens, now), "settle"):
                return
        self._unsent.append((spec, give_tokens, take_tokens))  # sent when Redis returns

    def _orphan_reply(self, context: Any, reply: Any) -> None:
        """A reply nobody awaits: a settlement's (checked for an error), or an admission whose caller
        left while it was decided (its reservation is given back: the request was never run)."""
        if isinstance(reply, RespError):
            self._reply_error("settle" if context == "settle" else "admit", reply)
        elif isinstance(context, tuple) and isinstance(reply, bytes) and reply.startswith(b"0 "):
            spec, cost = context
            self._adjust(spec, cost, 0)

    # -- outages
    def _reply_error(self, op: str, error: RespError) -> None:
        self.metrics.errors.labels(op).inc()
        now_s = self._clock()
        if now_s - self._last_error_log_s >= 10.0:
            self._last_error_log_s = now_s
            log.warning("shared limits: Redis refused %s: %s", op, error)

    def _lost(self, conn: RespConnection, error: BaseException) -> None:
        if conn is not self._conn:
            return
        self._conn = None
        self._outage("timeout" if isinstance(error, TimeoutError) else "connection", error)
        self._retry_at_s = 0.0  # try again at once: a dropped connection is not yet an outage
        self._reconnect()

    def _outage(self, op: str, error: BaseException) -> None:
        self.metrics.errors.labels(op).inc()
        self.metrics.redis_up.set(0)
        if not self._in_outage:
            self._in_outage = True
            log.warning("shared limits: Redis unavailable (%s: %r); admitting %s until it answers again", op, error,
                        {"local": f"on local buckets of limit / {self.settings.gateway_count}",
                         "fail_open": "every request", "fail_closed": "nothing (503)"}[self.settings.on_redis_error])

    def _reconnect(self) -> None:
        if self._connecting is None and not self._closed and self._clock() >= self._retry_at_s:
            self._connecting = asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        settings = self.settings
        conn: RespConnection | None = None
        try:
            conn = await RespConnection.open(settings.redis_url, settings.redis_timeout_s,
                                             max(1.0, settings.redis_timeout_s), self._lost, self._orphan_reply)
            for script in (ADMIT_SCRIPT, ADJUST_SCRIPT):
                await conn.call(encode_command(b"SCRIPT", b"LOAD", script.encode()))
            await self._reconcile(conn)
        except asyncio.CancelledError:
            if conn is not None:
                conn.close()
            raise
        except Exception as error:  # noqa: BLE001 - any failure to connect is an outage
            if conn is not None:
                conn.close()
            self._outage("connect", error)
            self._retry_at_s = self._clock() + settings.redis_retry_s
            return
        finally:
            self._connecting = None
        self._conn = conn
        self.metrics.redis_up.set(1)
        if self._in_outage:
            self._in_outage = False
            log.warning("shared limits: Redis answers again; admissions are decided there")

    async def _reconcile(self, conn: RespConnection) -> None:
        """On Redis's return: what the local buckets admitted beyond their refill is charged there
        (every gateway adds its own draw), and settlements that could not be sent are sent."""
        now = b"" if self._redis_now is None else b"%.17g" % self._redis_now()
        replies: list[asyncio.Future] = []
        if self._local_used:
            draws = self._local.drawn(self._clock())
            self._local = self._limiter.scaled(self.settings.gateway_count)
            self._local_used = False
            for draw in draws:
                scopes = tuple(s for s in self._limiter.limits_for(draw.tenant, draw.model or "")
                               if s.model == draw.model)
                if scopes:
                    # local buckets hold 1/gateway_count of a limit: their draw is this gateway's
                    spec = _Spec(draw.tenant, draw.model or "", scopes, self.settings.key_prefix)
                    replies.append(conn.call(spec.adjust(draw.requests, 0, draw.tokens, now)))
        unsent, self._unsent = self._unsent, deque(maxlen=self._unsent.maxlen)
        for spec, give, take in unsent:
            replies.append(conn.call(spec.adjust(0, give, take, now)))
        for reply in replies:
            try:
                await reply
            except RespError as error:
                self._reply_error("reconcile", error)
