"""API key -> tenant and tier. Pure: the caller passes the presented key, gets a decision back.

Keys are stored as SHA-256 digests (config may hold only hashes) and compared with
`hmac.compare_digest` against every configured digest, so neither the result nor the position of a
match leaks through timing (the usual API-key scheme of Stripe/GitHub-style tokens: store the hash,
compare in constant time). With auth off, every request is one anonymous tenant.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "ANONYMOUS_TENANT",
    "ApiKeyEntry",
    "Identity",
    "IdentityOutcome",
    "IdentityDecision",
    "IdentityResolver",
    "hash_api_key",
]

ANONYMOUS_TENANT = "anonymous"


def hash_api_key(api_key: str) -> str:
    """The hex SHA-256 digest stored in config in place of the key itself."""
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True)
class ApiKeyEntry:
    key_sha256: str  # hex digest of the key, as `hash_api_key` gives it
    tenant: str
    tier: str | None = None  # None: the tier table's default tier

    def __post_init__(self) -> None:
        if len(self.key_sha256) != 64 or any(c not in "0123456789abcdef" for c in self.key_sha256):
            raise ValueError(f"tenant {self.tenant}: key_sha256 must be 64 lowercase hex digits")

    @classmethod
    def from_plain_key(cls, api_key: str, tenant: str, tier: str | None = None) -> ApiKeyEntry:
        return cls(hash_api_key(api_key), tenant, tier)


@dataclass(frozen=True, slots=True)
class Identity:
    tenant: str
    tier: str | None  # None: the default tier
    # requests the gateway makes itself as re-runnable background work (the batch worker's): the pool
    # controller may stop them for a better tier's waiting request (`policy.pool`, rule 9)
    preemptible: bool = False


class IdentityOutcome(Enum):
    AUTHENTICATED = "authenticated"
    ANONYMOUS = "anonymous"  # auth is off
    MISSING_KEY = "missing_key"  # -> 401
    INVALID_KEY = "invalid_key"  # -> 401


@dataclass(frozen=True, slots=True)
class IdentityDecision:
    outcome: IdentityOutcome
    identity: Identity | None  # None exactly when the outcome is a 401

    @property
    def authenticated(self) -> bool:
        return self.identity is not None


class IdentityResolver:
    """Resolves the bearer token of a request. Auth is on exactly when keys are configured."""

    def __init__(self, entries: Iterable[ApiKeyEntry] = (), *, anonymous_tier: str | None = None) -> None:
        self._entries = tuple((bytes.fromhex(e.key_sha256), Identity(e.tenant, e.tier)) for e in entries)
        self._anonymous = IdentityDecision(IdentityOutcome.ANONYMOUS, Identity(ANONYMOUS_TENANT, anonymous_tier))

    @property
    def auth_enabled(self) -> bool:
        return bool(self._entries)

    def resolve(self, api_key: str | None) -> IdentityDecision:
        if not self._entries:
            return self._anonymous
        if not api_key:
            return IdentityDecision(IdentityOutcome.MISSING_KEY, None)
        presented = hashlib.sha256(api_key.encode("utf-8")).digest()
        found: Identity | None = None
        # No early exit: every entry is compared, so the time taken does not say which one matched.
        for digest, identity in self._entries:
            if hmac.compare_digest(presented, digest):
                found = identity
        if found is None:
            return IdentityDecision(IdentityOutcome.INVALID_KEY, None)
        return IdentityDecision(IdentityOutcome.AUTHENTICATED, found)
