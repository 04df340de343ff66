"""Overload config sections -> policy constructors."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tidegate.overload_config import build_policies, parse_overload_sections
from tidegate.policy.identity import IdentityOutcome, hash_api_key
from tidegate.policy.pool import PoolReplica


def _pools(*names: str) -> dict[str, list[PoolReplica]]:
    return {name: [PoolReplica(f"{name}#0")] for name in names}


def _sections(**overrides: object) -> dict:
    base = {
        "tenants": {
            "acme": {"api_keys": ["sk-acme"], "tier": "critical", "requests_per_minute": 10},
            "beta": {"api_key_sha256": [hash_api_key("sk-beta")], "weight": 2.0,
                     "models": {"small": {"tokens_per_minute": 1000}}},
        },
        "tiers": None,
        "limits": {"default": {"requests_per_minute": 5}, "engine_share": 0.4},
        "degradation": {"pools": {"big": {"fallback_pool": "small"}}},
    }
    base.update(overrides)
    return base


def test_absent_sections_give_anonymous_default_tiers() -> None:
    config = parse_overload_sections({})
    policies = build_policies(config, _pools("m"))
    assert policies.identity.resolve(None).outcome is IdentityOutcome.ANONYMOUS
    assert [tier.name for tier in policies.control.tiers] == ["critical", "standard", "sheddable", "batch"]


def test_plain_and_hashed_keys_both_resolve_to_their_tenant() -> None:
    policies = build_policies(parse_overload_sections(_sections()), _pools("big", "small"))
    acme = policies.identity.resolve("sk-acme").identity
    beta = policies.identity.resolve("sk-beta").identity
    assert (acme.tenant, acme.tier) == ("acme", "critical")
    assert (beta.tenant, beta.tier) == ("beta", None)
    assert policies.identity.resolve("sk-nope").outcome is IdentityOutcome.INVALID_KEY


def test_fallback_pool_reaches_the_ladder() -> None:
    policies = build_policies(parse_overload_sections(_sections()), _pools("big", "small"))
    assert policies.control.pools["big"].ladder.config.fallback_pool == "small"
    assert policies.control.pools["small"].ladder.config.fallback_pool is None


def test_custom_tier_levels_replace_the_defaults() -> None:
    tiers = {"default": "low", "levels": {"high": {"rank": 0, "max_queue_wait_s": 1, "ttft_target_s": 2},
                                          "low": {"rank": 1, "max_queue_wait_s": 5, "ttft_target_s": 9}}}
    config = parse_overload_sections(_sections(tiers=tiers, tenants={}))
    assert [tier.name for tier in config.tiers.table()] == ["high", "low"]


def test_unknown_key_is_named() -> None:
    with pytest.raises(ValidationError, match="requests_per_minit"):
        parse_overload_sections({"limits": {"default": {"requests_per_minit": 5}}})


def test_tenant_with_unknown_tier_is_refused() -> None:
    with pytest.raises(ValidationError, match="unknown tier"):
        parse_overload_sections({"tenants": {"x": {"tier": "gold"}}})


def test_malformed_key_hash_is_refused() -> None:
    with pytest.raises(ValidationError, match="64 lowercase hex"):
        parse_overload_sections({"tenants": {"x": {"api_key_sha256": ["abc"]}}})


def test_degradation_for_unknown_pool_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown fallback pool"):
        build_policies(parse_overload_sections(_sections()), _pools("big"))


def test_the_old_slot_limit_section_is_named_with_what_replaced_it() -> None:
    with pytest.raises(ValidationError, match="limits.slots is no longer read.*engine_share"):
        parse_overload_sections({"limits": {"slots": {"initial": 8}}})


@pytest.mark.parametrize(("slot_limit", "share", "max_requests", "headroom"),
                         [(64, 1 / 3, 43, 21), (48, 1 / 3, 32, 16), (1, 1 / 3, 1, 0), (8, 0.0, 8, 0)])
def test_a_backends_slot_limit_splits_into_requests_and_headroom(slot_limit: int, share: float, max_requests: int,
                                                                 headroom: int) -> None:
    limits = parse_overload_sections({"limits": {"headroom_share": share}}).limits
    replica = limits.pool_replica("r", slot_limit, orders_by_priority=True)
    assert (replica.max_requests, replica.headroom) == (max_requests, headroom)
    assert replica.max_requests + replica.headroom == slot_limit


def test_engine_share_reaches_every_pools_controller() -> None:
    policies = build_policies(parse_overload_sections(_sections()), _pools("big", "small"))
    assert {p.controller.settings.engine_share for p in policies.control.pools.values()} == {0.4}
