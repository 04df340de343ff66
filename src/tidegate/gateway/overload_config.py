"""Config sections of overload control (`tenants`, `tiers`, `limits`, `degradation`) and their policies.

The sections are typed here and turned into the pure policies' constructors by `build_policies`,
so `config.py` only has to hold them. Absent sections mean: auth off (one anonymous tenant), the
default four tiers, no rate limits, adaptive slots with default bounds, the preset reply as the
only rung below the primary pool.

```yaml
tenants:
  acme:
    api_key_sha256: ["<64 hex digits>"]   # the config need hold only hashes
    api_keys: ["${ACME_KEY}"]               # or plain keys (hashed at load; handy with env vars)
    tier: critical
    weight: 2.0                             # fair-share weight within its tier
    requests_per_minute: 600
    tokens_per_minute: 200000
    models: {big-model: {tokens_per_minute: 50000}}
tiers:
  default: standard
  levels: {critical: {rank: 0, queue_bound: 1000, max_queue_wait_s: 2.5, ttft_target_s: 3.0}, ...}
limits:
  default: {requests_per_minute: 60}        # tenants without their own limit
  max_queued: 10000                         # per pool, all tiers together
  slots: {target_latency_s: 0.5, initial: 4, minimum: 1, maximum: 256}
  isolation: {over_share_factor: 2.0}     # a tenant's flood cannot slow its tier's others; null: off
degradation:
  preset_reply: "系统繁忙，请稍后重试"
  pools: {big-model: {fallback_pool: small-model}}
```
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from tidegate.policy.admission import RateLimit, RateLimiter
from tidegate.policy.concurrency import AimdSlotLimit, GradientSlotLimit, ReplicaSlots, SlotLimitBounds
from tidegate.policy.degradation import LadderConfig
from tidegate.policy.identity import ApiKeyEntry, IdentityResolver
from tidegate.policy.overload import OverloadControl, PoolPolicies
from tidegate.policy.prediction import WorkUnit
from tidegate.policy.shares import TenantShares
from tidegate.policy.tiers import TierSpec, TierTable, default_tiers

__all__ = [
    "LimitConfig",
    "TenantConfig",
    "TierConfig",
    "TiersConfig",
    "SlotAlgorithm",
    "SlotsConfig",
    "IsolationConfig",
    "LimitsConfig",
    "PoolLadderConfig",
    "DegradationConfig",
    "OverloadConfig",
    "OverloadPolicies",
    "check_tenant_tiers",
    "parse_overload_sections",
    "build_policies",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LimitConfig(_Strict):
    requests_per_minute: int | None = Field(None, gt=0)
    tokens_per_minute: int | None = Field(None, gt=0)

    def policy(self) -> RateLimit:
        return RateLimit(self.requests_per_minute, self.tokens_per_minute)


class TenantConfig(LimitConfig):
    api_key_sha256: tuple[str, ...] = ()  # hex SHA-256 of each key: the config need not hold keys
    api_keys: tuple[SecretStr, ...] = ()  # plain keys, hashed at load
    tier: str | None = None  # None: the default tier
    weight: float = Field(1.0, gt=0)
    models: dict[str, LimitConfig] = {}  # per-model limits, on top of the tenant's own

    @field_validator("api_key_sha256")
    @classmethod
    def _hex_digests(cls, digests: tuple[str, ...]) -> tuple[str, ...]:
        lowered = tuple(digest.lower() for digest in digests)
        for digest in lowered:
            ApiKeyEntry(digest, "-")  # raises for anything but 64 hex digits
        return lowered

    @property
    def has_limit(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


class TierConfig(_Strict):
    rank: int = Field(ge=0)
    queue_bound: int = Field(1000, ge=0)
    max_queue_wait_s: float = Field(gt=0)
    ttft_target_s: float = Field(gt=0)
    aging_offset_s: float | None = Field(None, ge=0)
    degrade_at_pressure: float = Field(1.0, gt=0)


class TiersConfig(_Strict):
    default: str = "standard"
    levels: dict[str, TierConfig] | None = None  # None: critical / standard / sheddable / batch

    def table(self) -> TierTable:
        if self.levels is None:
            builtin = default_tiers()
            return TierTable(builtin, default_tier=self.default)
        return TierTable((TierSpec(name, **level.model_dump()) for name, level in self.levels.items()),
                         default_tier=self.default)


class SlotAlgorithm(str, Enum):
    GRADIENT = "gradient"
    AIMD = "aimd"


class SlotsConfig(_Strict):
    """Adaptive slots per replica: no static limit, only a latency target and bounds."""

    algorithm: SlotAlgorithm = SlotAlgorithm.GRADIENT
    # replica latency (dispatch to first token; whole answer when not streamed) the limit aims at
    target_latency_s: float = Field(0.5, gt=0)
    initial: int = Field(4, ge=1)
    minimum: int = Field(1, ge=1)
    maximum: int = Field(256, ge=1)
    window_s: float = Field(1.0, ge=0)
    # slots per replica above the adaptive limit that only the best tier may take: a critical
    # request then finds a slot at once, instead of waiting for one to free under a flood
    priority_headroom: int = Field(1, ge=0)
    # the best tier's recent concurrency (time-averaged, this half-life) is reserved inside each
    # replica's limit: lower tiers fill only the rest, so a critical request joins a batch still at
    # the latency target instead of one over it. null: no reserve (headroom only)
    priority_reserve_half_life_s: float | None = Field(5.0, gt=0)
    # while the best tier has been holding slots (its reserve is non-zero), each replica's limit
    # aims at this tighter target instead: the reserve alone only moves slots, and the limit, which
    # measures every request, would regrow until the whole batch (critical requests in it) sat at
    # `target_latency_s`. null: one target for every tier
    best_tier_target_latency_s: float | None = Field(None, gt=0)
    # a replica that misses the target even at `minimum` slots (slow host, contention) gets a limit
    # aimed at this many times that measured floor for `floor_ttl_s`, instead of being pinned at the
    # minimum where it serves least and still misses. null: pinned at the minimum
    floor_tolerance: float | None = Field(1.5, ge=1)
    floor_ttl_s: float = Field(30.0, gt=0)
    # while requests wait in the gateway for the pool's slots, limits aim at up to this many times
    # the target: a real engine's throughput keeps rising with its batch, and a request waiting in
    # the gateway gains more from the queue draining faster than the bigger batch costs it (never
    # for the best tier's target). null: the target holds whatever waits
    backlog_tolerance: float | None = Field(1.5, ge=1)

    @model_validator(mode="after")
    def _ordered_bounds(self) -> SlotsConfig:
        if not self.minimum <= self.initial <= self.maximum:
            raise ValueError("need minimum <= initial <= maximum")
        if self.best_tier_target_latency_s is not None and self.best_tier_target_latency_s > self.target_latency_s:
            raise ValueError("best_tier_target_latency_s must not exceed target_latency_s")
        return self

    def new_slots(self, ceiling: int | None = None, isolation_tolerance: float | None = None) -> ReplicaSlots:
        """Slots for one replica; `ceiling`: the backend's own `slot_limit`, never exceeded;
        `isolation_tolerance`: `IsolationConfig.latency_tolerance` when isolation is on."""
        maximum = self.maximum if ceiling is None else max(1, min(self.maximum, ceiling))
        minimum = min(self.minimum, maximum)
        bounds = SlotLimitBounds(min(max(self.initial, minimum), maximum), minimum, maximum)
        kind = GradientSlotLimit if self.algorithm is SlotAlgorithm.GRADIENT else AimdSlotLimit
        limit = kind(self.target_latency_s, bounds=bounds, window_s=self.window_s,
                     floor_tolerance=self.floor_tolerance, floor_ttl_s=self.floor_ttl_s,
                     backlog_tolerance=self.backlog_tolerance)
        return ReplicaSlots(limit, best_tier_target_s=self.best_tier_target_latency_s,
                            isolation_tolerance=isolation_tolerance)


class IsolationConfig(_Strict):
    """Tenant isolation within a tier (`policy.shares`): while a tenant sends more than
    `over_share_factor` x its fair share, requests of the tier's other tenants are protected (the
    headroom, a reserve of their own, no target stretched for the flood's backlog; with
    `latency_tolerance`, limits aimed at the latency from before the flood), so the flood's excess
    gets only the slots they leave."""

    over_share_factor: float = Field(2.0, ge=1)
    rate_half_life_s: float = Field(5.0, gt=0)  # arrival and service rates are averaged this long
    # while a tenant floods, replica limits aim at this many times the latency they answered with
    # before the flood (never above the target); the flood's requests, demoted in the engine, hold
    # no slot against the others, so the smaller limit squeezes the flood, not them. null: the target
    latency_tolerance: float | None = Field(1.1, ge=1)

    def shares(self, tenant_weights: Mapping[str, float] | None) -> TenantShares:
        return TenantShares(half_life_s=self.rate_half_life_s, over_share_factor=self.over_share_factor,
                            tenant_weights=tenant_weights)


class LimitsConfig(_Strict):
    default: LimitConfig | None = None  # for tenants without a limit of their own; None: unlimited
    max_queued: int = Field(10_000, ge=0)  # per pool, every tier together
    slots: SlotsConfig = SlotsConfig()
    isolation: IsolationConfig | None = IsolationConfig()  # null: no isolation beyond fair queueing
    predict_in: WorkUnit = WorkUnit.TOKENS  # the unit of queued work for the wait prediction
    default_max_tokens: int = Field(256, ge=1)  # reserved when a request names no max_tokens


class PoolLadderConfig(_Strict):
    fallback_pool: str | None = None
    preset_reply: str | None = None  # None: the section's preset reply


class DegradationConfig(_Strict):
    preset_reply: str = LadderConfig().preset_reply  # the message of the 503; any language
    min_retry_after_s: float = Field(1.0, ge=0)
    pools: dict[str, PoolLadderConfig] = {}

    def ladder(self, pool: str) -> LadderConfig:
        own = self.pools.get(pool, PoolLadderConfig())
        return LadderConfig(fallback_pool=own.fallback_pool,
                            preset_reply=own.preset_reply if own.preset_reply is not None else self.preset_reply,
                            min_retry_after_s=self.min_retry_after_s)


class OverloadConfig(_Strict):
    """The four sections together; each may be absent from the file."""

    tenants: dict[str, TenantConfig] = {}
    tiers: TiersConfig = TiersConfig()
    limits: LimitsConfig = LimitsConfig()
    degradation: DegradationConfig = DegradationConfig()

    @model_validator(mode="after")
    def _references_exist(self) -> OverloadConfig:
        check_tenant_tiers(self.tenants, self.tiers)
        return self

    @property
    def auth_enabled(self) -> bool:
        return any(t.api_key_sha256 or t.api_keys for t in self.tenants.values())


def check_tenant_tiers(tenants: Mapping[str, TenantConfig], tiers: TiersConfig) -> None:
    """Raises ValueError for bad tiers (default, ranks) or a tenant in a tier that does not exist."""
    table = tiers.table()
    for name, tenant in tenants.items():
        if tenant.tier is not None and tenant.tier not in table:
            raise ValueError(f"tenant {name}: unknown tier {tenant.tier!r}")


def parse_overload_sections(sections: Mapping[str, Any]) -> OverloadConfig:
    """The overload config from a config file's `tenants`/`tiers`/`limits`/`degradation` mappings.

    Raises ValueError (pydantic's ValidationError) naming the bad key.
    """
    present = {key: value for key, value in sections.items() if value is not None}
    return OverloadConfig.model_validate(present)


@dataclass(frozen=True)
class OverloadPolicies:
    """What the gateway needs at startup: the policies, wired from config."""

    identity: IdentityResolver
    control: OverloadControl
    config: OverloadConfig


def _key_entries(tenants: Mapping[str, TenantConfig]) -> Iterable[ApiKeyEntry]:
    for name, tenant in tenants.items():
        for digest in tenant.api_key_sha256:
            yield ApiKeyEntry(digest, name, tenant.tier)
        for key in tenant.api_keys:
            yield ApiKeyEntry.from_plain_key(key.get_secret_value(), name, tenant.tier)


def build_policies(config: OverloadConfig, pools: Iterable[str]) -> OverloadPolicies:
    """Constructs identity, rate limiter, tiers and per-pool queue/predictor/ladder.

    Raises ValueError when a degradation entry names a pool that does not exist.
    """
    pool_names = list(pools)
    for name, ladder in config.degradation.pools.items():
        if name not in pool_names:
            raise ValueError(f"degradation.pools: unknown pool {name!r}")
        if ladder.fallback_pool is not None and ladder.fallback_pool not in pool_names:
            raise ValueError(f"degradation.pools.{name}: unknown fallback pool {ladder.fallback_pool!r}")
    tiers = config.tiers.table()
    tenants = config.tenants
    limiter = RateLimiter(
        {name: t.policy() for name, t in tenants.items() if t.has_limit},
        model_limits={(name, model): limit.policy() for name, t in tenants.items()
                      for model, limit in t.models.items()},
        default_limit=config.limits.default.policy() if config.limits.default is not None else None,
    )
    weights = {name: t.weight for name, t in tenants.items() if t.weight != 1.0} or None
    isolation = config.limits.isolation
    control = OverloadControl(tiers, limiter, {
        name: PoolPolicies.create(name, tiers, max_queued=config.limits.max_queued,
                                  ladder=config.degradation.ladder(name), tenant_weights=weights,
                                  unit=config.limits.predict_in,
                                  shares=isolation.shares(weights) if isolation is not None else None)
        for name in pool_names})
    return OverloadPolicies(IdentityResolver(_key_entries(tenants)), control, config)

