"""The engine's Prometheus metrics, in a registry of its own (the gateway reads the first four)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["EngineMetrics"]

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("tidegate_engine_running_sequences", "Sequences holding KV blocks", registry=r)
        self.waiting = Gauge("tidegate_engine_waiting_sequences", "Sequences queued or preempted", registry=r)
        self.kv_usage = Gauge("tidegate_engine_kv_cache_usage", "Fraction 0-1 of KV-cache blocks in use", registry=r)
        # what the gateway's prefix index for this replica is sized by (`policy.prefix`); 0 until loaded
        self.kv_capacity = Gauge("tidegate_engine_kv_cache_capacity_tokens",
                                 "Tokens the KV cache holds in all (blocks x block size)", registry=r)
        self.ttft = Histogram(
            "tidegate_engine_ttft_seconds", "Request arrival to first token", buckets=_LATENCY_BUCKETS_S, registry=r
        )
        self.inter_token = Histogram(
            "tidegate_engine_inter_token_seconds", "Gap between tokens of one stream", buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "tidegate_engine_e2e_seconds", "Request arrival to last token", buckets=_LATENCY_BUCKETS_S, registry=r
        )
        self.prompt_tokens = Counter("tidegate_engine_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("tidegate_engine_generation_tokens", "Tokens generated", registry=r)
        # its rate is the engine's busy fraction, the analogue of a GPU's utilisation
        self.busy = Counter("tidegate_engine_busy_seconds", "Wall time spent in model steps", registry=r)
        self.step_batch_size = Histogram(
            "tidegate_engine_step_batch_size", "Sequences in one engine step", buckets=_BATCH_BUCKETS, registry=r
        )
        # prefix caching; hit rate = rate(hits) / rate(queries). Exposed with the `_total` suffix
        self.prefix_cache_queries = Counter(
            "tidegate_engine_prefix_cache_queries_tokens",
            "Tokens of admitted sequences looked up in the prefix cache", registry=r,
        )
        self.prefix_cache_hits = Counter(
            "tidegate_engine_prefix_cache_hits_tokens", "Looked-up tokens found in the prefix cache", registry=r
        )
        self.prefix_cache_evictions = Counter(
            "tidegate_engine_prefix_cache_evictions", "Cached KV blocks evicted for another use", registry=r
        )

    def add_prefix_cache_counts(self, queried_tokens: int, hit_tokens: int, evicted_blocks: int) -> None:
        """Called by the engine thread with what the block manager counted since the last call."""
        if queried_tokens:
            self.prefix_cache_queries.inc(queried_tokens)
        if hit_tokens:
            self.prefix_cache_hits.inc(hit_tokens)
        if evicted_blocks:
            self.prefix_cache_evictions.inc(evicted_blocks)

    def set_state(self, running: int, waiting: int, kv_usage: float) -> None:
        """Called by the engine thread after each iteration (prometheus-client is thread-safe)."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
