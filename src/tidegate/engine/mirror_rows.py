"""Which row of the decode mirror each decoding sequence holds: PURE (no torch), so that the
simulator's modelled replica hands out rows as the engine does (`DecodeMirror`).

The batched decode attention runs over every row up to the highest one in use, each row read to
the step's longest context (bench/decode_attention_grid.py: a step costs as rows x the longest
context). A sequence keeps its row while it decodes step after step; one that skips a step
(finished, preempted, or not decoding) frees it. The rows in use are kept dense, [0, n) for n
decoding sequences: a row freed below a live one is filled at once by the highest live row, moved
down (its K/V copied once). Without the move, a freed row stayed in the attention's batch, masked
but computed, until a new decode took it: on the served steps of `bench/calibrate_cpu_profile.py`
the attention then ran over more rows than decodes in about half the steps, 1.4x as many on
average, and a move costs one row's copy, not a masked row in every later step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

__all__ = ["MirrorRows", "RowMove"]


class RowMove(NamedTuple):
    """A live sequence's row moved down into a freed one: its first `positions` K/V to copy."""

    source: int
    target: int
    positions: int


class MirrorRows:
    def __init__(self) -> None:
        self.row_of: dict[Any, int] = {}  # sequence (by identity) -> row, rows in use [0, len)
        self.filled: dict[int, int] = {}  # row -> positions [0, n) hold that row's sequence's K/V

    @property
    def allocated(self) -> int:
        """The rows in use: every one below this (they are kept dense)."""
        return len(self.filled)

    def release_absent(self, present: Iterable[Any]) -> list[RowMove]:
        """Frees the rows of the sequences not decoding in this step, then moves the highest rows in
        use down into the freed rows below them, so that the rows in use are [0, n) again; returns
        the moves, for the holder of the rows' K/V to copy before anything reads them."""
        keep = set(present)  # sequences hash by identity
        freed = []
        for seq in [s for s in self.row_of if s not in keep]:
            row = self.row_of.pop(seq)
            del self.filled[row]
            freed.append(row)
        live = len(self.filled)
        holes = sorted(row for row in freed if row < live)
        if not holes:
            return []
        # as many live rows sit at or past `live` as there are holes below it
        movers = sorted((row, seq) for seq, row in self.row_of.items() if row >= live)
        moves = []
        for target, (source, seq) in zip(holes, movers):
            positions = self.filled.pop(source)
            self.filled[target] = positions
            self.row_of[seq] = target
            moves.append(RowMove(source, target, positions))
        return moves

    def rows_needed(self, decoding: Iterable[Any]) -> int:
        return len(self.row_of) + sum(1 for seq in decoding if seq not in self.row_of)

    def row(self, seq: Any) -> int:
        """`seq`'s row: its own, else the next one past those in use (empty: `filled` 0)."""
        row = self.row_of.get(seq)
        if row is None:
            row = self.row_of[seq] = len(self.filled)
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
