"""Traffic mix: tenants (API key, tier, share), token-length distributions, synthetic prompts.

PURE (shared with the simulator): draws take a seeded `numpy.random.Generator`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

__all__ = [
    "Tenant",
    "LengthDistribution",
    "parse_tenant",
    "parse_length",
    "load_mix_file",
    "assign_tenants",
    "synthetic_prompt",
    "DEFAULT_TENANT",
]


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    api_key: str
    tier: str
    share: float = 1.0  # relative weight in the mix; shares need not sum to 1


DEFAULT_TENANT = Tenant(name="default", api_key="", tier="standard", share=1.0)


def parse_tenant(spec: str) -> Tenant:
    """`name:key:tier:share`, e.g. `acme:sk-acme:critical:0.2` (the key may be empty)."""
    parts = spec.split(":")
    if len(parts) != 4:
        raise ValueError(f"tenant must be name:key:tier:share, got {spec!r}")
    name, key, tier, share = parts
    if not name or not tier:
        raise ValueError(f"tenant needs a name and a tier: {spec!r}")
    share_value = float(share)
    if share_value <= 0:
        raise ValueError(f"tenant share must be positive: {spec!r}")
    return Tenant(name=name, api_key=key, tier=tier, share=share_value)


def load_mix_file(path: str | Path) -> list[Tenant]:
    """YAML: `tenants: [{name, key, tier, share}, ...]`."""
    import yaml

    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    tenants = [
        Tenant(name=str(t["name"]), api_key=str(t.get("key", "")), tier=str(t.get("tier", "standard")),
               share=float(t.get("share", 1.0)))
        for t in data.get("tenants", [])
    ]
    if not tenants:
        raise ValueError(f"{path}: no tenants listed")
    return tenants


def assign_tenants(rng: np.random.Generator, tenants: Sequence[Tenant], count: int) -> np.ndarray:
    """Index into `tenants` for each of `count` requests, drawn by share."""
    shares = np.asarray([t.share for t in tenants], dtype=np.float64)
    return rng.choice(len(tenants), size=count, p=shares / shares.sum())


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """Token counts: `const:N`, `uniform:LO:HI` (inclusive) or `lognormal:MEDIAN:SIGMA`."""

    kind: str
    a: float
    b: float = 0.0
    minimum: int = 1

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        if self.kind == "const":
            values = np.full(count, self.a)
        elif self.kind == "uniform":
            values = rng.integers(int(self.a), int(self.b) + 1, size=count)
        elif self.kind == "lognormal":
            values = np.rint(rng.lognormal(np.log(self.a), self.b, size=count))
        else:
            raise ValueError(f"unknown length distribution {self.kind!r}")
        return np.maximum(values, self.minimum).astype(np.int64)

    def describe(self) -> str:
        return {"const": f"const:{self.a:g}", "uniform": f"uniform:{self.a:g}:{self.b:g}",
                "lognormal": f"lognormal:{self.a:g}:{self.b:g}"}[self.kind]


def parse_length(spec: str) -> LengthDistribution:
    kind, *params = spec.split(":")
    try:
        numbers = [float(p) for p in params]
    except ValueError as error:
        raise ValueError(f"bad length distribution {spec!r}: {error}") from None
    expected = {"const": 1, "uniform": 2, "lognormal": 2}
    if kind not in expected or len(numbers) != expected[kind]:
        raise ValueError(f"length must be const:N, uniform:LO:HI or lognormal:MEDIAN:SIGMA, got {spec!r}")
    if kind == "uniform" and numbers[0] > numbers[1]:
        raise ValueError(f"uniform needs LO <= HI: {spec!r}")
    return LengthDistribution(kind, *numbers)


# Printable ASCII words: one byte = one token for the embedded model's byte-level tokenizer.
_FILLER = (
    "the quick brown fox jumps over the lazy dog while tides rise and fall along the quiet harbour "
    "gate keepers count ships and the lighthouse keeps its steady beam across the water at night "
)


def synthetic_prompt(target_tokens: int, nonce: int) -> str:
    """A prompt of exactly `target_tokens` bytes; the nonce up front defeats exact-match caches
    so a load test measures the engine, not the cache."""
    head = f"[{nonce}] "
    if target_tokens <= len(head):
        return head[: max(target_tokens, 1)]
    body_len = target_tokens - len(head)
    repeats = body_len // len(_FILLER) + 1
    return head + (_FILLER * repeats)[:body_len]
