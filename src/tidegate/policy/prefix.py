"""Prefix affinity: which replica probably holds a request's prompt prefix in its engine's KV cache.

Engines with prefix caching (vLLM, SGLang, `tidegate engine`) skip the prefill of a prompt's leading
blocks they still hold; a request sent where its prefix is cached starts sooner and costs the
replica less. The gateway cannot see the engines' caches, so it keeps, per replica, the prefix
blocks it recently sent there (llm-d's approximate prefix scorer), bounded like the engine's cache
(least recently routed forgotten first): its KV capacity in tokens, as configured or as the engine
reports it, in the characters a token the engines' usage shows (`index_blocks`, `CharsPerToken`).
A prompt is cut into blocks of text, each named by a hash chained to the one before it, so a
block's name stands for the whole prefix up to it.

The controller (`policy.pool`) turns a match into the prefill tokens the replica would skip, and
routes by predicted time to the first token with that discount: affinity and load are weighed in one
unit, so a hot prefix spreads to a second replica once the first one's queue costs more than the
prefill it saves (`test_a_hot_prefix_spreads_once_its_replica_is_busier_than_the_prefill_it_saves`).
Affinity also fixes how the pool's load splits between replicas: `AffinityLoad` keeps the recent
load of each replica and each prefix, so that a busier replica can hand a whole prefix over.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["BLOCK_CHARS", "BLOCK_TOKENS", "CHARS_PER_TOKEN", "MAX_BLOCKS", "prefix_blocks", "index_blocks",
           "CharsPerToken", "PrefixIndex", "AffinityLoad"]

# characters of prompt text a token, until the engines' usage says otherwise: OpenAI's rule of thumb
# for English and a BPE tokenizer (a byte-level one, as the embedded engine's, counts 1)
CHARS_PER_TOKEN = 4.0
# ~16 tokens at ~4 characters a token: the engines' KV block (vLLM's and ours hold 16 tokens)
BLOCK_CHARS = 64
BLOCK_TOKENS = BLOCK_CHARS // int(CHARS_PER_TOKEN)
# a prompt's first 32k characters: past that, a longer match changes no routing decision
MAX_BLOCKS = 512


def prefix_blocks(parts: Iterable[str]) -> tuple[int, ...]:
    """Chained hashes of the full `BLOCK_CHARS` blocks of the parts joined (a chat's roles and
    contents in order); a partial last block is left out, as engines cache full blocks only."""
    text = "\x1e".join(parts)
    count = min(len(text) // BLOCK_CHARS, MAX_BLOCKS)
    chained = 0
    blocks = []
    for start in range(0, count * BLOCK_CHARS, BLOCK_CHARS):
        chained = hash((chained, text[start:start + BLOCK_CHARS]))
        blocks.append(chained)
    return tuple(blocks)


def index_blocks(kv_cache_tokens: int, chars_per_token: float) -> int:
    """The blocks of a replica's index whose engine's KV cache holds `kv_cache_tokens` tokens: the
    index counts blocks of characters, the engine tokens (at least one block)."""
    return max(1, int(kv_cache_tokens * chars_per_token) // BLOCK_CHARS)


class CharsPerToken:
    """Prompt characters (as `prefix_blocks` joins a prompt's parts) a token of the engines' usage,
    over about the last `memory_tokens` tokens reported; `CHARS_PER_TOKEN` until `min_tokens` are.
    It turns an engine's KV capacity in tokens into the index's characters: the embedded engine's
    byte tokens are 1 character each, a BPE model's about 4, and an index sized at 4 for a byte
    model believes its replica holds 4x the prompts its engine can."""

    def __init__(self, memory_tokens: float = 65536.0, min_tokens: float = 2048.0) -> None:
        if memory_tokens <= 0 or min_tokens < 0:
            raise ValueError("memory_tokens > 0 and min_tokens >= 0 needed")
        self.memory_tokens = memory_tokens
        self.min_tokens = min_tokens
        self._chars = 0.0  # both sums decay by e^(-tokens / memory) at each report
        self._tokens = 0.0
        self._seen_tokens = 0.0  # never decays: enough reported to trust the ratio

    def observe(self, prompt_chars: int, prompt_tokens: int) -> None:
        """A prompt of `prompt_chars` characters was `prompt_tokens` tokens at its engine (changes state)."""
        if prompt_chars <= 0 or prompt_tokens <= 0:
            return
        keep = math.exp(-prompt_tokens / self.memory_tokens)
        self._chars = self._chars * keep + prompt_chars
        self._tokens = self._tokens * keep + prompt_tokens
        self._seen_tokens += prompt_tokens

    def value(self) -> float:
        return self._chars / self._tokens if self._seen_tokens >= self.min_tokens else CHARS_PER_TOKEN


class PrefixIndex:
    """The prefix blocks recently routed to one replica, least recently routed evicted first."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def resize(self, capacity_blocks: int) -> None:
        """Holds at most `capacity_blocks` from now, the least recently routed past it forgotten now
        (changes state): its engine's cache turned out smaller or larger than thought."""
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.capacity_blocks = capacity_blocks
        held = self._blocks
        while len(held) > capacity_blocks:
            held.popitem(last=False)

    def matched(self, blocks: tuple[int, ...]) -> int:
        """How many of `blocks`, from the first, this replica probably holds (a query)."""
        held = self._blocks
        count = 0
        for block in blocks:
            if block not in held:
                break
            count += 1
        return count

    def forget(self, blocks: tuple[int, ...]) -> None:
        """`blocks` moved to another replica: not to be counted as held here any more (changes state;
        the engine evicts them in its own time)."""
        for block in blocks:
            self._blocks.pop(block, None)

    def record(self, blocks: tuple[int, ...]) -> None:
        """`blocks` were just routed here: most recent now; the oldest past capacity forgotten.
        Recorded last block first, so that a prefix is forgotten from its tail, as its head is what
        every longer prompt starting with it matches first."""
        held = self._blocks
        for block in reversed(blocks):
            if block in held:
                held.move_to_end(block)
            else:
                held[block] = None
        while len(held) > self.capacity_blocks:
            held.popitem(last=False)


class AffinityLoad:
    """Requests recently sent to each replica, and of them each prefix's, decaying with a half-life:
    the load a replica carries and what moving one prefix elsewhere would shift.

    Affinity keeps a prefix where it is cached, so the split of the pool's load between replicas is
    the split of its prefixes, fixed when each was first sent. Popular and quiet tenants then land
    unevenly: with tenants' traffic in a Zipf mix, one of two replicas served 2.5x the other's
    requests at 56 % busy (`sim.scenarios.prefix_clients`, its skewed case). The controller moves a
    whole prefix from a busier replica to the least busy one when their recent loads differ by more
    than noise and the move evens them out (`move_target`; `PoolController`, rule 7). Counted in
    requests with a prefix: a prefix's share of them is its tenant's share of the traffic, whatever
    its lengths; requests without one go where the load is least at once, and are not counted."""

    def __init__(self, half_life_s: float, capacity_prefixes: int = 4096) -> None:
        if half_life_s <= 0 or capacity_prefixes < 1:
            raise ValueError("half_life_s > 0 and capacity_prefixes >= 1 needed")
        self.half_life_s = half_life_s
        self.capacity_prefixes = capacity_prefixes
        # loads are kept grown by 2^((t - origin) / half-life) at each request's time t, so that one
        # power at the time asked turns them all into decayed loads (no power per entry)
        self._origin_s = 0.0
        self._replicas: dict[str, float] = {}
        self._prefixes: OrderedDict[int, float] = OrderedDict()  # a prefix's last block -> its load

    def _growth(self, now_s: float) -> float:
        # past 1,000 half-lives every load has decayed to nothing; the cap keeps the power a float
        # (a gateway idle for hours before its next request with a prefix)
        return 2.0 ** min((now_s - self._origin_s) / self.half_life_s, 1000.0)

    def replica_load(self, now_s: float, replica_id: str) -> float:
        return self._replicas.get(replica_id, 0.0) / self._growth(now_s)

    def prefix_load(self, now_s: float, key: int) -> float:
        return self._prefixes.get(key, 0.0) / self._growth(now_s)

    def record(self, now_s: float, replica_id: str, key: int | None) -> None:
        """A request with a prefix was sent to `replica_id`; `key` names the prefix it found there
        by its last block (None: none there yet) (changes state)."""
        if now_s - self._origin_s > 64 * self.half_life_s:  # keep the grown loads within a float's range
            self._rebase(now_s)
        weight = self._growth(now_s)
        self._replicas[replica_id] = self._replicas.get(replica_id, 0.0) + weight
        if key is None:
            return
        self._prefixes[key] = self._prefixes.get(key, 0.0) + weight
        self._prefixes.move_to_end(key)
        if len(self._prefixes) > self.capacity_prefixes:
            self._prefixes.popitem(last=False)

    def move(self, now_s: float, key: int, source: str, target: str) -> None:
        """The prefix `key` now goes to `target`: its recent load counts there (changes state)."""
        shifted = self._prefixes.get(key, 0.0)
        self._replicas[source] = max(0.0, self._replicas.get(source, 0.0) - shifted)
        self._replicas[target] = self._replicas.get(target, 0.0) + shifted

    def move_target(self, now_s: float, key: int, source: str, candidates: Iterable[str]) -> str | None:
        """The least loaded of `candidates` if moving the prefix `key` there from `source` evens their
        recent loads out, else None (a query). Their difference d must be over twice the standard
        deviation it would have were requests sent at random (a split noise alone makes is not
        corrected), and the move, which narrows it by 2 x min(m, d - m) for m the prefix's own
        load, must narrow it by more than that deviation (a move costs a prompt's prefill: a tiny
        prefix buys too little, and one as big as the gap only flips it). A move back then
        narrows nothing: no prefix moves back and forth. Asking for a narrowing of twice the
        deviation instead left `prefix_clients`' Zipf mix at 1.39x and moved nothing in a live
        bench/prefix_cache.py run of 64 requests split 44 / 20 (one worker 52 % busy)."""
        growth = self._growth(now_s)
        target = min(candidates, key=lambda replica: self._replicas.get(replica, 0.0), default=None)
        if target is None:
            return None
        high = self._replicas.get(source, 0.0) / growth
        low = self._replicas.get(target, 0.0) / growth
        moved = self._prefixes.get(key, 0.0) / growth
        noise = math.sqrt(high + low)
        return target if high - low > 2.0 * noise and 2.0 * min(moved, high - low - moved) > noise else None

    def _rebase(self, now_s: float) -> None:
        """Loads grown to `now_s` become the new origin's (changes state; the loads they stand for do not)."""
        shrink = 1.0 / self._growth(now_s)
        self._origin_s = now_s
        for loads in (self._replicas, self._prefixes):
            for name in loads:
                loads[name] *= shrink
