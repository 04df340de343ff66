"""Which row of the decode mirror each decoding sequence holds: PURE (no torch), so that the
simulator's modelled replica hands out rows as the engine does (`DecodeMirror`).

The batched decode attention runs over every row up to the highest one in use, each row read to
the step's longest context (bench/decode_attention_grid.py: a step costs as decodes x the longest
context). A sequence keeps its row while it decodes step after step; one that skips a step
(finished, preempted, or not decoding) frees it, and a new decode takes the lowest free row. So a
row freed below a live one stays in the attention's batch, masked, until a new decode fills it:
on the served steps of `bench/calibrate_cpu_profile.py` the attention ran over more rows than
decodes in about half the steps, 1.4x as many on average.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Any

__all__ = ["MirrorRows"]


class MirrorRows:
    def __init__(self) -> None:
        self.row_of: dict[Any, int] = {}  # sequence (by identity) -> row
        self.filled: dict[int, int] = {}  # row -> positions [0, n) hold that row's sequence's K/V
        self._free: list[int] = []  # a heap, so the lowest rows are reused first

    @property
    def allocated(self) -> int:
        """Every row index handed out since the last reset is below this."""
        return len(self.filled) + len(self._free)

    def release_absent(self, present: Iterable[Any]) -> None:
        """Frees the rows of the sequences not decoding in this step."""
        keep = set(present)  # sequences hash by identity
        for seq in [s for s in self.row_of if s not in keep]:
            row = self.row_of.pop(seq)
            del self.filled[row]
            heapq.heappush(self._free, row)

    def rows_needed(self, decoding: Iterable[Any]) -> int:
        return len(self.row_of) + sum(1 for seq in decoding if seq not in self.row_of)

    def row(self, seq: Any) -> int:
        """`seq`'s row: its own, else the lowest free one (empty: `filled` 0)."""
        row = self.row_of.get(seq)
        if row is None:
            row = self.row_of[seq] = heapq.heappop(self._free) if self._free else self.allocated
            self.filled[row] = 0
        return row

    def attention_rows(self, decoding: list[Any]) -> int:
        """A step's rows as the engine's mirror gives them (within its budget): the sequences not in
        `decoding` freed, the rest placed; the attention reads rows [0, returned)."""
        self.release_absent(decoding)
        return max((self.row(seq) for seq in decoding), default=-1) + 1

    def reset(self) -> None:
        self.row_of.clear()
        self.filled.clear()
        self._free.clear()
