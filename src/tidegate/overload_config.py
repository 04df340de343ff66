"""Config sections of overload control (`tenants`, `tiers`, `limits`, `degradation`) and their policies.

The sections are typed here and turned into the pure policies' constructors by `build_policies`,
so `config.py` only has to hold them. Absent sections mean: auth off (one anonymous tenant), the
default four tiers, no rate limits, the pool controller's measured defaults, the preset reply as the
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
  engine_share: 0.5                         # of a tier's TTFT target, the engine's queue may take
  headroom_share: 0.33                      # of a replica's slot_limit: the most kept for better levels
  isolation: {over_share_factor: 2.0}     # a flooding tenant goes one engine level down; null: off
degradation:
  preset_reply: "系统繁忙，请稍后重试"
  pools: {big-model: {fallback_pool: small-model}}
```
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from tidegate.policy.admission import RateLimit, RateLimiter
from tidegate.policy.degradation import LadderConfig
from tidegate.policy.health import BreakerPolicy
from tidegate.policy.identity import ApiKeyEntry, IdentityResolver
from tidegate.policy.length_classes import LengthClasses
from tidegate.policy.overload import OverloadControl, PoolPolicies
from tidegate.policy.pool import PoolController, PoolReplica, PoolSettings
from tidegate.policy.shares import TenantShares
from tidegate.policy.tiers import TierSpec, TierTable, default_tiers

__all__ = [
    "LimitConfig",
    "TenantConfig",
    "TierConfig",
    "TiersConfig",
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
    # false: this tenant's requests are never answered from or kept in the cache; sampled: its sampled
    # requests are cached too (a hit repeats one earlier sample), in pools with a response cache
    response_cache: Literal["sampled"] | bool = True

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


class IsolationConfig(_Strict):
    """Tenant isolation within a tier (`policy.shares`): while a tenant sends more than
    `over_share_factor` x its fair share, its requests go to the engine one level below its tier's
    other tenants (the pool controller's rule 2), so its excess gets only what they leave."""

    over_share_factor: float = Field(2.0, ge=1)
    rate_half_life_s: float = Field(5.0, gt=0)  # arrival and service rates are averaged this long

    def shares(self, tenant_weights: Mapping[str, float] | None) -> TenantShares:
        return TenantShares(half_life_s=self.rate_half_life_s, over_share_factor=self.over_share_factor,
                            tenant_weights=tenant_weights)


_REPLACED_KEYS = {
    "slots": "the adaptive slot limit was replaced by the pool controller's work budget: see "
             "limits.engine_share and limits.headroom_share (docs/overload-knobs.md)",
    "predict_in": "the wait is predicted in tokens",
}


class LimitsConfig(_Strict):
    default: LimitConfig | None = None  # for tenants without a limit of their own; None: unlimited
    max_queued: int = Field(10_000, ge=1)  # per pool, every tier together
    # the share of a tier's TTFT target the engine's own queue may take (the controller's rule 3)
    engine_share: float = Field(0.5, gt=0, le=1)
    # the most of a replica's `slot_limit` that only a better engine level may take (rule 5; the
    # controller keeps less while the better levels' arrivals need less)
    headroom_share: float = Field(1 / 3, ge=0, lt=1)
    isolation: IsolationConfig | None = IsolationConfig()  # null: no isolation beyond fair queueing
    default_max_tokens: int = Field(256, ge=1)  # reserved when a request names no max_tokens
    # prompt tokens of prefixes remembered per replica for prefix-aware routing (rule 7): what one
    # replica's KV cache holds. null: as each engine reports on its /metrics (an upstream backend's
    # `kv_cache_tokens` first), 32,768 where none does; 0: no prefix affinity (docs/caching.md)
    prefix_cache_tokens: int | None = Field(None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _name_replaced_keys(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            for key, why in _REPLACED_KEYS.items():
                if key in data:
                    raise ValueError(f"limits.{key} is no longer read: {why}")
        return data

    def pool_replica(self, replica_id: str, slot_limit: int, orders_by_priority: bool,
                     kv_cache_tokens: int | None = None) -> PoolReplica:
        """A replica as its pool's controller sees it: `slot_limit` split into the requests of one
        level and better, and the headroom only better levels may take; its KV cache's tokens as
        configured (its backend's `kv_cache_tokens`, else `prefix_cache_tokens`), over what its
        engine reports."""
        headroom = min(slot_limit - 1, round(slot_limit * self.headroom_share))
        return PoolReplica(replica_id, max_requests=slot_limit - headroom, headroom=headroom,
                           orders_by_priority=orders_by_priority,
                           kv_cache_tokens=kv_cache_tokens or self.prefix_cache_tokens or None)


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


def build_policies(config: OverloadConfig, pools: Mapping[str, Sequence[PoolReplica]],
                   breaker: BreakerPolicy = BreakerPolicy(),
                   length_classes: Mapping[str, LengthClasses] = {}) -> OverloadPolicies:
    """Constructs identity, rate limiter, tiers and each pool's controller and ladder.

    `pools`: each pool's replicas (`LimitsConfig.pool_replica`); `length_classes`: those of the pools
    that split prompts by length. Raises ValueError when a degradation entry names a pool that does
    not exist.
    """
    for name, ladder in config.degradation.pools.items():
        if name not in pools:
            raise ValueError(f"degradation.pools: unknown pool {name!r}")
        if ladder.fallback_pool is not None and ladder.fallback_pool not in pools:
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
    limits = config.limits
    # a replica none configures nor reports keeps the controller's default; 0 turns affinity off
    affinity = {} if limits.prefix_cache_tokens is None else {"prefix_cache_tokens": limits.prefix_cache_tokens}
    settings = PoolSettings(engine_share=limits.engine_share, max_queued=limits.max_queued, breaker=breaker,
                            **affinity)
    # without API keys every request is one anonymous tenant: nobody to isolate from anybody
    isolation = limits.isolation if config.auth_enabled else None
    control = OverloadControl(tiers, limiter, {
        name: PoolPolicies.create(name, PoolController(
            replicas, tiers, settings, shares=isolation.shares(weights) if isolation is not None else None,
            tenant_weights=weights, length_classes=length_classes.get(name)), config.degradation.ladder(name))
        for name, replicas in pools.items()})
    return OverloadPolicies(IdentityResolver(_key_entries(tenants)), control, config)
