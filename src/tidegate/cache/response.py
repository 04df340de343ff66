"""The exact response cache's pure half: what may be cached, its keys, its entries, and the in-process
LRU tier bounded in bytes. The gateway (`gateway/response_cache.py`) adds Redis, coalescing and HTTP.

Two keys per request, both scoped by tenant (no answer ever crosses tenants):
- the exact key hashes the whole canonical request (model, messages or prompt, every sampling
  parameter, `stream`); a hit answers only a request that would get the same answer;
- the loose key leaves out the sampling parameters (temperature, top_p, seed, max_tokens, ...):
  it finds "an answer to this same question" for the ladder's cached-answer rung, under overload,
  where a possibly different sample beats a refusal. It is never used for a normal hit.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple

import orjson

__all__ = ["CacheMode", "CachedAnswer", "CacheKeys", "cache_mode", "is_deterministic", "request_keys",
           "SemanticQuestion", "semantic_question", "MemoryTier"]

# fields that never change an answer: who asked (scoped separately), bookkeeping, the gateway's own
_IGNORED_FIELDS = frozenset(("user", "metadata", "store", "priority", "service_tier", "request_id"))
# sampling parameters: left out of the loose key only
_SAMPLING_FIELDS = frozenset((
    "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "max_completion_tokens", "n_predict",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos", "logit_bias",
))


class CacheMode(Enum):
    BYPASS = "bypass"  # neither read nor written (sampled request, `no-store`, tenant opted out)
    USE = "use"  # read, and written on a miss
    REFRESH = "refresh"  # `Cache-Control: no-cache`: not read, the fresh answer written


def is_deterministic(body: dict[str, Any]) -> bool:
    """The same request gets the same answer: greedy (temperature 0), a fixed seed, or an embedding."""
    if "input" in body and "messages" not in body and "prompt" not in body:
        return True  # embeddings
    temperature = body.get("temperature", 1.0)
    return temperature == 0 or body.get("seed") is not None


def cache_mode(body: dict[str, Any], cache_control: bytes | None, *, cache_sampled: bool,
               tenant_allows: bool) -> CacheMode:
    """How the response cache treats this request. `cache_sampled`: the pool also caches requests
    that are not deterministic (an opt-in: a hit then repeats one sample)."""
    if not tenant_allows:
        return CacheMode.BYPASS
    directives = cache_control.lower() if cache_control else b""
    if b"no-store" in directives:
        return CacheMode.BYPASS
    if not (cache_sampled or is_deterministic(body)):
        return CacheMode.BYPASS
    return CacheMode.REFRESH if b"no-cache" in directives else CacheMode.USE


@dataclass(frozen=True, slots=True)
class CacheKeys:
    exact: str
    loose: str


def request_keys(scope: str, endpoint: str, body: dict[str, Any]) -> CacheKeys:
    """Keys of a request: SHA-256 of its canonical JSON (sorted keys), scoped by tenant and endpoint."""
    kept = {name: value for name, value in body.items() if name not in _IGNORED_FIELDS}
    loose = {name: value for name, value in kept.items() if name not in _SAMPLING_FIELDS}
    head = f"{scope}\x00{endpoint}\x00".encode()
    option = orjson.OPT_SORT_KEYS
    return CacheKeys(hashlib.sha256(head + orjson.dumps(kept, option=option)).hexdigest(),
                     hashlib.sha256(head + b"loose\x00" + orjson.dumps(loose, option=option)).hexdigest())


class SemanticQuestion(NamedTuple):
    scope: str  # everything but the last user turn: a normal semantic hit must match it exactly
    loose_scope: str  # the same without the sampling parameters: for the ladder's cached-answer rung
    text: str  # the last user turn


def semantic_question(scope: str, endpoint: str, body: dict[str, Any]) -> SemanticQuestion | None:
    """The semantic cache's view of a chat whose last turn is a user's text: the scope hashes
    everything but that turn (tenant, model, system prompt, earlier turns, every parameter), so a
    semantic hit differs from its entry in the wording of the last question only. None for
    anything else (completions, a last turn that is not the user's plain text)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "user" or not isinstance(last.get("content"), str):
        return None
    kept = {name: value for name, value in body.items() if name not in _IGNORED_FIELDS and name != "messages"}
    kept["earlier"] = messages[:-1]
    loose = {name: value for name, value in kept.items() if name not in _SAMPLING_FIELDS}
    head = f"{scope}\x00{endpoint}\x00semantic\x00".encode()
    option = orjson.OPT_SORT_KEYS
    return SemanticQuestion(hashlib.sha256(head + orjson.dumps(kept, option=option)).hexdigest(),
                            hashlib.sha256(head + b"loose\x00" + orjson.dumps(loose, option=option)).hexdigest(),
                            last["content"])


@dataclass(frozen=True, slots=True)
class CachedAnswer:
    """A complete 200 answer: the whole body, or a stream's pieces as the client received them."""

    content_type: bytes
    streamed: bool
    pieces: tuple[bytes, ...]  # one piece when not streamed

    @property
    def size_bytes(self) -> int:
        return sum(len(piece) for piece in self.pieces) + len(self.content_type) + 64

    def encode(self) -> bytes:
        """For Redis: a JSON head line with the pieces' lengths, then the pieces back to back."""
        head = orjson.dumps({"v": 1, "ct": self.content_type.decode("latin-1"), "s": self.streamed,
                             "n": [len(piece) for piece in self.pieces]})
        return head + b"\n" + b"".join(self.pieces)

    @classmethod
    def decode(cls, data: bytes) -> CachedAnswer:
        """Raises ValueError for anything this version did not write."""
        line, _, rest = data.partition(b"\n")
        try:
            head = orjson.loads(line)
            lengths = head["n"]
            if head.get("v") != 1 or sum(lengths) != len(rest):
                raise ValueError("not a cached answer of this version")
            pieces, at = [], 0
            for length in lengths:
                pieces.append(rest[at:at + length])
                at += length
            return cls(head["ct"].encode("latin-1"), bool(head["s"]), tuple(pieces))
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"not a cached answer: {error}") from None


class MemoryTier:
    """In-process LRU of answers bounded in bytes, plus loose key -> exact key links."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, CachedAnswer] = OrderedDict()
        self._loose: OrderedDict[str, str] = OrderedDict()  # bounded by the entries' count
        self.bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def peek(self, key: str) -> CachedAnswer | None:
        """The entry, without marking it used."""
        return self._entries.get(key)

    def peek_loose(self, loose_key: str) -> CachedAnswer | None:
        exact = self._loose.get(loose_key)
        return None if exact is None else self._entries.get(exact)

    def touch(self, key: str) -> CachedAnswer | None:
        """The entry, marked most recently used."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, keys: CacheKeys, entry: CachedAnswer) -> None:
        """Stores `entry` under `keys.exact`, links `keys.loose` to it, and evicts the least recently
        used entries past the byte bound. An entry larger than the bound is not stored."""
        size = entry.size_bytes
        if size > self.max_bytes:
            return
        old = self._entries.pop(keys.exact, None)
        if old is not None:
            self.bytes -= old.size_bytes
        self._entries[keys.exact] = entry
        self.bytes += size
        self._loose[keys.loose] = keys.exact
        self._loose.move_to_end(keys.loose)
        while self.bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.size_bytes
            self.evictions += 1
        while len(self._loose) > 2 * len(self._entries) + 16:  # links to evicted entries
            self._loose.popitem(last=False)
