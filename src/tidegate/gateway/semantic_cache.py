"""The semantic response cache, live: a paraphrase of a cached chat question gets the cached answer.

Opt-in per pool (`response_cache.semantic`). The last user turn is embedded by the pool named in
`embedding_pool` (the embedded all-MiniLM-L6-v2 by default), looked up in an in-process index
(`cache.semantic.SemanticIndex`: cosine above the threshold, and the answer-token guard: numbers,
negations, names, units, dates must agree) within its scope: tenant, model, system prompt, earlier
turns and every parameter must match exactly (`cache.response.semantic_question`). Entries point at
exact-cache keys; their answers live in the response cache's tiers. With Redis, entries are kept
there too (same TTL), and a gateway that starts loads them, so every gateway shares them.
An embedding that fails or is slow is a miss: the request goes on to the engines.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import orjson
from prometheus_client import CollectorRegistry, Counter, Histogram

from tidegate.cache.semantic import SemanticEntry, SemanticHit, SemanticIndex
from tidegate.gateway.dispatch import Replica
from tidegate.policy.health import is_routable

__all__ = ["SemanticSettings", "SemanticMetrics", "Embedder", "SemanticCache", "encode_entry", "decode_entry"]

log = logging.getLogger("tidegate.cache")

_EMBEDDING_DIM = 384  # all-MiniLM-L6-v2; another model's size is taken from its first answer


class SemanticSettings:
    __slots__ = ("embedding_pool", "threshold", "rung_threshold", "max_entries", "embed_timeout_s")

    def __init__(self, embedding_pool: str, threshold: float, rung_threshold: float | None = None,
                 max_entries: int = 10_000, embed_timeout_s: float = 1.0) -> None:
        self.embedding_pool = embedding_pool
        self.threshold = threshold
        self.rung_threshold = rung_threshold  # looser, for the ladder's cached-answer rung; None: not used there
        self.max_entries = max_entries
        self.embed_timeout_s = embed_timeout_s


class Embedder:
    """Embeds a text on a routable replica of the embedding pool (round robin), outside admission:
    the cache's own lookups are not a tenant's requests."""

    def __init__(self, replicas: Sequence[Replica], clock: Callable[[], float], timeout_s: float) -> None:
        self._replicas = replicas
        self._clock = clock
        self._timeout_s = timeout_s
        self._cursor = 0
        self._session: Any = None  # aiohttp.ClientSession, made on first use inside the loop

    async def embed(self, text: str) -> np.ndarray | None:
        replica = self._next_replica()
        if replica is None:
            return None
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._timeout_s))
        endpoint = replica.connections.endpoint
        scheme = "https" if endpoint.use_tls else "http"
        url = f"{scheme}://{endpoint.host}:{endpoint.port}{endpoint.base_path.decode()}/embeddings"
        auth = replica.auth_header  # b"authorization: Bearer <key>\r\n" or b""
        headers = {"authorization": auth[len(b"authorization: "):-2].decode()} if auth else {}
        try:
            async with self._session.post(url, json={"model": replica.upstream_model, "input": text},
                                          headers=headers) as response:
                if response.status != 200:
                    return None
                data = orjson.loads(await response.read())
            return np.asarray(data["data"][0]["embedding"], dtype=np.float32)
        except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, TypeError, ValueError):
            return None

    def _next_replica(self) -> Replica | None:
        now_s = self._clock()
        count = len(self._replicas)
        for step in range(count):
            replica = self._replicas[(self._cursor + step) % count]
            if is_routable(replica.health, replica.breaker, now_s):
                self._cursor = (self._cursor + step + 1) % count
                return replica
        return None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class SemanticMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.lookups = Counter("tidegate_semantic_cache_lookups", "Semantic lookups, by result: hit, miss, "
                               "rung_hit (the ladder's looser threshold), no_embedding", ["pool", "result"],
                               registry=registry)
        self.similarity = Histogram("tidegate_semantic_cache_hit_similarity", "Cosine similarity of the "
                                    "semantic hits served", ["pool"], buckets=(0.8, 0.85, 0.9, 0.95, 0.98, 1.0),
                                    registry=registry)


class SemanticCache:
    """One pool's semantic index and the embedder that feeds it."""

    def __init__(self, settings: SemanticSettings, embedder: Embedder, metrics: SemanticMetrics, pool: str) -> None:
        self.settings = settings
        self._embedder = embedder
        self.index = SemanticIndex(settings.max_entries, _EMBEDDING_DIM)
        self._pool = pool
        self._lookups = {result: metrics.lookups.labels(pool, result)
                         for result in ("hit", "miss", "rung_hit", "no_embedding")}
        self._similarity = metrics.similarity.labels(pool)

    async def embed(self, text: str) -> np.ndarray | None:
        vector = await self._embedder.embed(text)
        if vector is None:
            self._lookups["no_embedding"].inc()
            return None
        if vector.shape[0] != self.index.dim:  # another embedding model: its size, from its first answer
            if len(self.index):
                return None
            self.index = SemanticIndex(self.settings.max_entries, int(vector.shape[0]))
        return vector

    def lookup(self, scope: str, vector: np.ndarray, question: str, rung: bool = False) -> SemanticHit | None:
        """The best entry within the threshold (the rung's looser one with `rung`); a query."""
        threshold = self.settings.rung_threshold if rung else self.settings.threshold
        if threshold is None:
            return None
        try:
            hit = self.index.lookup(scope, vector, question, threshold)
        except ValueError:
            return None  # a zero or NaN embedding
        return hit

    def served(self, hit: SemanticHit, rung: bool = False) -> None:
        """A hit's answer was sent: its entry is recently used; counted."""
        self.index.touch(hit.entry_key)
        self._lookups["rung_hit" if rung else "hit"].inc()
        self._similarity.observe(hit.similarity)

    def missed(self) -> None:
        self._lookups["miss"].inc()

    def add(self, scope: str, vector: np.ndarray, question: str, entry_key: str) -> SemanticEntry | None:
        """Indexes a stored answer's question; the entry, for Redis."""
        try:
            self.index.add(scope, vector, question, entry_key)
        except ValueError:
            return None
        return SemanticEntry(scope, entry_key, question, np.asarray(vector, dtype="<f4").tobytes())

    def restore(self, entries: list[SemanticEntry]) -> None:
        try:
            self.index.restore(self.index.snapshot() + entries)
        except ValueError as error:
            log.warning("semantic cache: entries from Redis not loaded: %s", error)

    async def close(self) -> None:
        await self._embedder.close()


def encode_entry(entry: SemanticEntry) -> bytes:
    head = orjson.dumps({"scope": entry.scope, "key": entry.entry_key, "text": entry.text})
    return head + b"\n" + entry.vector


def decode_entry(data: bytes) -> SemanticEntry | None:
    line, _, vector = data.partition(b"\n")
    try:
        head = orjson.loads(line)
        return SemanticEntry(head["scope"], head["key"], head["text"], vector)
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
