"""MirrorRows, the pure row bookkeeping the engine's decode mirror and the simulator share."""

from __future__ import annotations

from tidegate.engine.mirror_rows import MirrorRows, RowMove


def test_freed_rows_below_live_ones_are_filled_by_the_highest_live_rows() -> None:
    rows, seqs = MirrorRows(), [object() for _ in range(5)]
    assert rows.attention_rows(seqs) == 5
    for row, seq in enumerate(seqs):
        rows.filled[row] = 10 + row
    moves = rows.release_absent([seqs[0], seqs[2], seqs[4]])  # rows 1 and 3 freed
    assert moves == [RowMove(source=4, target=1, positions=14)]
    assert sorted(rows.row_of.values()) == [0, 1, 2] and rows.row_of[seqs[4]] == 1 and rows.allocated == 3
    assert rows.filled == {0: 10, 1: 14, 2: 12}


def test_a_step_reads_one_row_a_decode_however_they_come_and_go() -> None:
    rows, seqs = MirrorRows(), [object() for _ in range(40)]
    live = list(seqs[:8])
    for step in range(60):  # sequences leave from anywhere and new ones join
        if step % 3 == 0:
            live.pop((step * 7) % len(live))
        if step % 2 == 0:
            live.append(seqs[8 + step // 2])
        assert rows.attention_rows(live) == len(live)
        assert sorted(rows.row_of.values()) == list(range(len(live)))
