"""KV-cache block manager: a fixed capacity in tokens, handed out in blocks of `block_size` tokens.

Pure bookkeeping: the runner owns the tensors and reads each sequence's `block_table` to find where
its keys and values live (slot = block * block_size + offset).
"""

from __future__ import annotations

from collections import deque

from tidegate.engine.sequence import Sequence

__all__ = ["BLOCK_SIZE", "BlockManager"]

BLOCK_SIZE = 16


def blocks_for(num_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, capacity_tokens: int, block_size: int = BLOCK_SIZE) -> None:
        if capacity_tokens < block_size:
            raise ValueError(f"KV capacity {capacity_tokens} is below one block of {block_size} tokens")
        self.block_size = block_size
        self.num_blocks = capacity_tokens // block_size
        self._free: deque[int] = deque(range(self.num_blocks))

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction 0-1 of blocks in use."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs to hold its first `num_tokens` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_table))

    def can_hold(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    def max_tokens_holdable(self, seq: Sequence) -> int:
        """How many tokens `seq` could hold in total if it took every free block."""
        return (len(seq.block_table) + len(self._free)) * self.block_size

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Gives `seq` enough blocks for its first `num_tokens` tokens; caller checked can_hold."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"sequence {seq.seq_id} needs {needed} blocks, {len(self._free)} free")
        seq.block_table.extend(self._free.popleft() for _ in range(needed))

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table.clear()
