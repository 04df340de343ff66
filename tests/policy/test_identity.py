"""API key -> tenant and tier: hashed keys, constant-time comparison, anonymous when auth is off."""

from __future__ import annotations

import pytest

from tidegate.policy.identity import (
    ANONYMOUS_TENANT,
    ApiKeyEntry,
    Identity,
    IdentityOutcome,
    IdentityResolver,
    hash_api_key,
)

RESOLVER = IdentityResolver([
    ApiKeyEntry.from_plain_key("sk-alpha", "alpha", "critical"),
    ApiKeyEntry(hash_api_key("sk-beta"), "beta"),
])


@pytest.mark.parametrize(
    ("presented", "outcome", "identity"),
    [
        ("sk-alpha", IdentityOutcome.AUTHENTICATED, Identity("alpha", "critical")),
        ("sk-beta", IdentityOutcome.AUTHENTICATED, Identity("beta", None)),
        ("sk-gamma", IdentityOutcome.INVALID_KEY, None),
        ("sk-alph", IdentityOutcome.INVALID_KEY, None),
        ("", IdentityOutcome.MISSING_KEY, None),
        (None, IdentityOutcome.MISSING_KEY, None),
    ],
)
def test_resolves_presented_key(presented: str | None, outcome: IdentityOutcome, identity: Identity | None) -> None:
    decision = RESOLVER.resolve(presented)
    assert (decision.outcome, decision.identity) == (outcome, identity)


def test_auth_off_gives_one_anonymous_tenant() -> None:
    resolver = IdentityResolver(anonymous_tier="standard")
    assert not resolver.auth_enabled
    decision = resolver.resolve("anything")
    assert decision.outcome is IdentityOutcome.ANONYMOUS
    assert decision.identity == Identity(ANONYMOUS_TENANT, "standard")


def test_config_holds_only_the_hash() -> None:
    entry = ApiKeyEntry.from_plain_key("sk-secret", "t")
    assert "sk-secret" not in repr(entry)
    assert entry.key_sha256 == hash_api_key("sk-secret")


def test_rejects_malformed_hash() -> None:
    with pytest.raises(ValueError):
        ApiKeyEntry("not-a-hash", "t")
