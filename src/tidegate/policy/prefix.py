"""Prefix affinity: which replica probably holds a request's prompt prefix in its engine's KV cache.

Engines with prefix caching (vLLM, SGLang, `tidegate engine`) skip the prefill of a prompt's leading
blocks they still hold; a request sent where its prefix is cached starts sooner and costs the
replica less. The gateway cannot see the engines' caches, so it keeps, per replica, the prefix
blocks it recently sent there (llm-d's approximate prefix scorer), bounded like the engine's cache
(least recently routed forgotten first). A prompt is cut into blocks of text, each named by a hash
chained to the one before it, so a block's name stands for the whole prefix up to it.

The controller (`policy.pool`) turns a match into the prefill tokens the replica would skip, and
routes by predicted time to the first token with that discount: affinity and load are weighed in one
unit, so a hot prefix spreads to a second replica once the first one's queue costs more than the
prefill it saves (`test_a_hot_prefix_spreads_once_its_replica_is_busier_than_the_prefill_it_saves`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["BLOCK_CHARS", "BLOCK_TOKENS", "MAX_BLOCKS", "prefix_blocks", "PrefixIndex"]

# ~16 tokens at ~4 characters a token: the engines' KV block (vLLM's and ours hold 16 tokens)
BLOCK_CHARS = 64
BLOCK_TOKENS = BLOCK_CHARS // 4
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


class PrefixIndex:
    """The prefix blocks recently routed to one replica, least recently routed evicted first."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def matched(self, blocks: tuple[int, ...]) -> int:
        """How many of `blocks`, from the first, this replica probably holds (a query)."""
        held = self._blocks
        count = 0
        for block in blocks:
            if block not in held:
                break
            count += 1
        return count

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
