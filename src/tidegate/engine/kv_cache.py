"""KV-cache block manager: a fixed capacity in tokens, handed out in blocks of `block_size` tokens,
with automatic prefix caching.

Pure bookkeeping: the runner owns the tensors and reads each sequence's `block_table` to find where
its keys and values live (slot = block * block_size + offset).

Prefix caching (what vLLM v1 calls automatic prefix caching; nano-vllm's block manager does the
same): once a full block's keys and values are computed, the block is registered under a hash of
its tokens chained to the hash of the block before it, so that the hash names the whole prefix up
to the block's end. A sequence admitted later whose tokens start the same way takes those blocks
(reference counted) instead of computing them again. A block that nobody holds any more keeps its
contents and its hash: it stays findable, and counts as free, until an allocation needs it. An
allocation takes blocks that hold no cached prefix first, then evicts the least recently freed
cached block. Only full, computed blocks are ever shared, and a sequence writes only past its
computed tokens, so no sequence writes into a block another one reads.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from tidegate.engine.sequence import Sequence

__all__ = ["BLOCK_SIZE", "BlockManager"]

BLOCK_SIZE = 16

# The chain's seed: the hash "before" a sequence's first block.
_ROOT_HASH = b""
_TOKEN_BYTES = array("q").itemsize  # token ids are hashed as 64-bit integers


def blocks_for(num_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-num_tokens // block_size)


def chained_block_hashes(parent_hash: bytes, token_ids: list[int], block_size: int = BLOCK_SIZE) -> list[bytes]:
    """The hashes of the full blocks of `token_ids`, which follow the prefix named by `parent_hash`:
    each block's hash covers its tokens and the hash of the block before it.

    SHA-256, not Python's `hash`: a collision would give one prompt another prompt's keys and
    values (a wrong answer, and a leak between tenants), and `hash` of a tuple of ints is unsalted,
    so collisions can be crafted; vLLM moved its prefix cache to SHA-256 for this reason."""
    data = array("q", token_ids).tobytes()  # one conversion for all the blocks: it costs per call
    width = block_size * _TOKEN_BYTES
    hashes = []
    for end in range(width, len(data) + 1, width):
        parent_hash = hashlib.sha256(parent_hash + data[end - width : end]).digest()
        hashes.append(parent_hash)
    return hashes


class BlockManager:
    def __init__(self, capacity_tokens: int, block_size: int = BLOCK_SIZE) -> None:
        if capacity_tokens < block_size:
            raise ValueError(f"KV capacity {capacity_tokens} is below one block of {block_size} tokens")
        self.block_size = block_size
        self.num_blocks = capacity_tokens // block_size
        self._free: deque[int] = deque(range(self.num_blocks))  # unheld, holding no cached prefix
        self._ref_counts = [0] * self.num_blocks  # sequences whose block table holds the block
        self._hash_of: list[bytes | int | None] = [None] * self.num_blocks  # the prefix a block caches
        self._cached: dict[bytes | int, int] = {}  # prefix hash -> the block caching it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unheld cached blocks, least recent first
        # monotonic counters, read by the engine loop for its metrics (this module stays pure)
        self.prefix_queried_tokens = 0  # tokens of admitted sequences looked up in the cache
        self.prefix_hit_tokens = 0  # of those, tokens found cached
        self.evicted_blocks = 0  # cached blocks given to another use

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: cached blocks nobody holds count, as they can be evicted."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a prefix a later sequence can find (held or not)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction 0-1 of blocks held by sequences (cached blocks nobody holds are free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs to hold its first `num_tokens` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_table))

    def can_hold(self, seq: Sequence, num_tokens: int, prefix: list[int] | None = None) -> bool:
        """Whether `seq` can hold its first `num_tokens` tokens; `prefix`: the cached blocks (from
        `cached_prefix`) it would share first, which it need not allocate, though those nobody
        holds stop being free once it holds them."""
        if not prefix:
            return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks
        needed = blocks_for(num_tokens, self.block_size) - len(seq.block_table) - len(prefix)
        unheld = sum(1 for block in prefix if self._ref_counts[block] == 0)
        return needed <= self.num_free_blocks - unheld

    def max_tokens_holdable(self, seq: Sequence) -> int:
        """How many tokens `seq` could hold in total if it took every free block."""
        return (len(seq.block_table) + self.num_free_blocks) * self.block_size

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Gives `seq` enough blocks for its first `num_tokens` tokens; caller checked can_hold."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed == 0:
            return  # most calls: a decode within its last block
        if needed > self.num_free_blocks:
            raise RuntimeError(f"sequence {seq.seq_id} needs {needed} blocks, {self.num_free_blocks} free")
        free, table = self._free, seq.block_table
        taken = min(needed, len(free))
        new_blocks = [free.popleft() for _ in range(taken)]
        if needed > taken:
            new_blocks += self._evict(needed - taken)
        ref_counts = self._ref_counts
        for block in new_blocks:
            ref_counts[block] = 1
        table += new_blocks

    def free(self, seq: Sequence) -> None:
        """Drops `seq`'s hold on its blocks. A cached block stays findable until it is evicted;
        its tail blocks are queued for eviction before its head, as a block is useless to a later
        sequence without the blocks before it."""
        ref_counts, hash_of = self._ref_counts, self._hash_of
        for block in reversed(seq.block_table):
            ref_counts[block] -= 1
            if ref_counts[block] > 0:
                continue
            if hash_of[block] is None:
                self._free.append(block)
            else:
                self._evictable[block] = None
        seq.block_table.clear()
        seq.num_cached_blocks = 0

    # ---- prefix caching ------------------------------------------------------------------------

    def is_cached(self, block: int) -> bool:
        """Whether `block` holds a prefix later sequences can find (nothing may write into it)."""
        return self._hash_of[block] is not None

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks holding `seq`'s leading full blocks, longest run first (a query). Never
        its last token's block: at least one token is left to compute, so that the step that
        computes it samples the next token, and writes only into a block of its own."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        prefix: list[int] = []
        most = (seq.num_tokens - 1) // self.block_size
        # hashes a block at a time: a prompt that shares nothing costs one hash, not one a block
        for index in range(most):
            block = self._cached.get(self._hashes_through(seq, index + 1)[index])
            if block is None:
                break
            prefix.append(block)
        return prefix

    def share_prefix(self, seq: Sequence, prefix: list[int]) -> None:
        """`seq`, being admitted with no blocks, takes `prefix` (from `cached_prefix`) as its first
        blocks; the caller marks their tokens computed. Counts the lookup for the hit rate."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        for block in prefix:
            if self._ref_counts[block] == 0:
                del self._evictable[block]
            self._ref_counts[block] += 1
        seq.block_table.extend(prefix)
        seq.num_cached_blocks = len(prefix)
        self.prefix_queried_tokens += seq.num_tokens
        self.prefix_hit_tokens += len(prefix) * self.block_size

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Registers `seq`'s full blocks whose keys and values are computed, so that later
        sequences find them. A prefix already cached in another block (two sequences computed it
        at once) keeps that block; this copy is plain and goes back to the free list when freed."""
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_cached_blocks:
            return  # most calls: a decode step that filled no block
        hashes = self._hashes_through(seq, full)
        cached, hash_of = self._cached, self._hash_of
        for index in range(seq.num_cached_blocks, full):
            block_hash, block = hashes[index], seq.block_table[index]
            if block_hash not in cached and hash_of[block] is None:
                cached[block_hash] = block
                hash_of[block] = block_hash
        seq.num_cached_blocks = full

    def cache_unique_blocks(self, seq: Sequence, finished: bool) -> None:
        """Registers the computed blocks of `seq`, whose prompt is unique (`Sequence.unique_prompt`),
        as it lets them go: no other sequence could have found them before.

        A preempted sequence's blocks are registered for its own recompute. A finished one's can
        be found by no one, and are registered only while other cached blocks wait for eviction,
        so that they age with them as the engine's would (least recently freed goes first). With
        none waiting, the free list gives the same order (its blocks are taken before any cached
        block freed later), so they go there unregistered: registering, then evicting, every
        block of every request took a fifth of the simulator's time. Such blocks are then reused
        without counting as evictions."""
        if finished and not self._evictable:
            return
        self.cache_computed_blocks(seq)

    def _hashes_through(self, seq: Sequence, count: int) -> list[bytes | int]:
        """`seq.block_hashes`, extended to at least `count` blocks. Each is computed once per
        sequence: its tokens never change, so the hashes outlive a preemption."""
        hashes = seq.block_hashes
        known = len(hashes)
        if known < count and seq.unique_prompt:
            # ints, not (seq_id, index) tuples, which made the garbage collector run 7x as often
            # in the simulator; they never equal a SHA-256 digest (bytes)
            base = seq.seq_id << 32
            hashes += range(base + known, base + count)
        elif known < count:
            size = self.block_size
            hashes += chained_block_hashes(hashes[-1] if hashes else _ROOT_HASH,
                                           seq.token_ids(known * size, (count - known) * size), size)
        return hashes

    def _evict(self, count: int) -> list[int]:
        """The `count` least recently freed cached blocks, no longer cached."""
        evictable, cached, hash_of = self._evictable, self._cached, self._hash_of
        blocks = [evictable.popitem(last=False)[0] for _ in range(count)]
        for block in blocks:
            del cached[hash_of[block]]  # type: ignore[arg-type]  # an evictable block has a hash
            hash_of[block] = None
        self.evicted_blocks += count
        return blocks
