"""A contiguous copy of the decoding sequences' K/V, kept current one token per step.

The paged cache scatters a sequence's context over blocks, so batched decode attention first had
to gather every decoding sequence's whole context into one padded tensor, in every layer, on
every step. On a 32-sequence decode of tiny-random-llama that copy (7 MB a layer) was 12 % of the
step in the profile, and the step ran ~25 % faster without it (the copy also evicted the weights
from the caches). The mirror gives each decoding sequence a row
of its own, filled once from the paged cache when the sequence starts decoding and then extended
by the step's new token, so attention reads K/V in place. The paged cache stays the source of
truth (prefill context, preemption); the mirror costs extra memory, capped at `budget_tokens`
(rows x row length), beyond which the runner falls back to the gather.

Rows belong to the sequences decoding in the current step: a sequence that skips a step loses
its row, and is refilled from the paged cache when it decodes again. The rows in use stay dense
(`MirrorRows`): a row freed below live ones takes the highest live row's K/V, copied once, so the
attention never computes a freed row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tidegate.engine.mirror_rows import MirrorRows

__all__ = ["DecodeMirror", "MirrorPlan", "context_slots"]

_ROW_ALIGN = 8
_LENGTH_ALIGN = 128


@dataclass(frozen=True)
class MirrorPlan:
    rows: torch.Tensor  # [B] the mirror row of each decode, in batch order
    num_rows: int  # attention runs over rows [0, num_rows): one a decode (rows are kept dense)
    length: int  # positions [0, length) are read; mask hides each row's tail
    mask: torch.Tensor  # [num_rows, 1, 1, length]
    positions: torch.Tensor  # [B] position of each decode's new token
    refills: tuple[tuple[int, torch.Tensor], ...]  # (row, cache slots of positions [0, p)) to copy first
    in_order: bool  # rows are 0..B-1 in batch order: no reordering of queries and outputs


class DecodeMirror:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, budget_tokens: int) -> None:
        self._shape = (num_layers, num_kv_heads, head_dim)
        self._dtype = dtype
        self.budget_tokens = budget_tokens
        self._rows = MirrorRows()  # which row each decoding sequence holds
        # positions the last plan copied: its refills, and the old rows when it grew the mirror
        # (for the engine's step log: copies the simulator's step cost may have to account for)
        self.copied_positions = 0
        self.reset()

    @property
    def capacity(self) -> tuple[int, int]:
        return self.k.shape[1], self.k.shape[2]

    def plan(self, decodes: list[tuple[Any, int, list[int]]], block_size: int) -> MirrorPlan | None:
        """`decodes`: (sequence, new token's position, block table) per decode, in batch order.
        None when the rows would not fit the budget (the caller gathers instead)."""
        self.copied_positions = 0
        table = self._rows
        moves = table.release_absent(seq for seq, _, _ in decodes)
        if not decodes:
            return None
        for move in moves:  # every layer's K and V at once, before any layer reads them
            self.k[:, move.target, : move.positions] = self.k[:, move.source, : move.positions]
            self.v[:, move.target, : move.positions] = self.v[:, move.source, : move.positions]
            self.copied_positions += move.positions
        length = max(position for _, position, _ in decodes) + 1
        rows_needed = table.rows_needed(seq for seq, _, _ in decodes)
        if not self._reserve(max(rows_needed, table.allocated), length):
            self.reset()
            return None
        rows, refills = [], []
        for seq, position, block_table in decodes:
            row = table.row(seq)
            if table.filled[row] != position:
                refills.append((row, context_slots(block_table, position, block_size)))
                self.copied_positions += position
            table.filled[row] = position + 1
            rows.append(row)
        num_rows = max(rows) + 1
        positions = torch.tensor([position for _, position, _ in decodes])
        row_tensor = torch.tensor(rows)
        lengths = torch.ones(num_rows, dtype=torch.long)  # rows are dense: each is overwritten below
        lengths[row_tensor] = positions + 1
        mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
        in_order = rows == list(range(len(rows)))
        return MirrorPlan(row_tensor, num_rows, length, mask[:, None, None, :], positions, tuple(refills), in_order)

    def reset(self) -> None:
        """Frees the memory; the next plan refills every row."""
        self.k = self.v = torch.zeros(self._shape[0], 0, 0, *self._shape[1:], dtype=self._dtype)
        self._rows.reset()

    def _reserve(self, rows: int, length: int) -> bool:
        cap_rows, cap_length = self.capacity
        if rows <= cap_rows and length <= cap_length:
            return True
        new_rows = max(cap_rows, -(-rows // _ROW_ALIGN) * _ROW_ALIGN)
        new_length = max(cap_length, -(-length // _LENGTH_ALIGN) * _LENGTH_ALIGN)
        if new_rows * new_length > self.budget_tokens:
            return False
        layers, heads, dim = self._shape
        k = torch.zeros(layers, new_rows, new_length, heads, dim, dtype=self._dtype)
        v = torch.zeros_like(k)
        k[:, :cap_rows, :cap_length] = self.k
        v[:, :cap_rows, :cap_length] = self.v
        self.copied_positions += cap_rows * cap_length
        self.k, self.v = k, v
        return True


def context_slots(block_table: list[int], length: int, block_size: int) -> torch.Tensor:
    """The cache slots of positions [0, length) of the sequence with this block table."""
    blocks = torch.tensor(block_table[: -(-length // block_size)], dtype=torch.long)
    return (blocks.unsqueeze(1) * block_size + torch.arange(block_size)).flatten()[:length]
