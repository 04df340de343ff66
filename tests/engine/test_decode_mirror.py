"""DecodeMirror's row bookkeeping: which rows decodes get, when rows are refilled, the budget."""

from __future__ import annotations

import torch

from tidegate.engine.decode_mirror import DecodeMirror

BLOCK = 4


def _mirror(budget_tokens: int = 1 << 16) -> DecodeMirror:
    return DecodeMirror(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, budget_tokens=budget_tokens)


class Seq:  # rows are keyed by identity, like the engine's Sequence (eq=False)
    def __init__(self, blocks: list[int]) -> None:
        self.block_table = blocks


def _decode(*pairs: tuple[Seq, int]) -> list[tuple[Seq, int, list[int]]]:
    return [(seq, position, seq.block_table) for seq, position in pairs]


def test_new_decodes_get_rows_in_order_and_a_refill_of_their_context() -> None:
    a, b = Seq([3, 7]), Seq([5])
    plan = _mirror().plan(_decode((a, 5), (b, 2)), BLOCK)
    assert plan is not None and plan.rows.tolist() == [0, 1] and plan.in_order
    assert plan.num_rows == 2 and plan.length == 6
    refills = {row: slots.tolist() for row, slots in plan.refills}
    assert refills == {0: [12, 13, 14, 15, 28], 1: [20, 21]}  # positions [0, p) through the block table
    assert plan.mask[:, 0, 0].tolist() == [[True] * 6, [True] * 3 + [False] * 3]


def test_a_row_that_decoded_last_step_is_extended_not_refilled() -> None:
    mirror, a = _mirror(), Seq([0, 1])
    mirror.plan(_decode((a, 5)), BLOCK)
    plan = mirror.plan(_decode((a, 6)), BLOCK)
    assert plan is not None and plan.refills == () and plan.positions.tolist() == [6]


def test_a_sequence_that_skips_a_step_loses_its_row_and_is_refilled() -> None:
    mirror, a, b = _mirror(), Seq([0, 1]), Seq([2, 3])
    mirror.plan(_decode((a, 5), (b, 5)), BLOCK)
    mirror.plan(_decode((b, 6)), BLOCK)  # a was preempted or prefilled this step: b moved down to row 0
    plan = mirror.plan(_decode((a, 6), (b, 7)), BLOCK)
    assert plan is not None
    assert plan.rows.tolist() == [1, 0]  # a took the next row past those in use
    assert [row for row, _ in plan.refills] == [1]


def test_a_freed_row_below_live_ones_takes_the_highest_live_row_so_rows_stay_dense() -> None:
    """The attention computes every row up to the highest in use: a freed row left between live ones
    would be computed, masked, on every step until a new decode took it."""
    mirror, a, b, c = _mirror(), Seq([0, 1]), Seq([2, 3]), Seq([4, 5])
    mirror.plan(_decode((a, 4), (b, 4), (c, 4)), BLOCK)
    mirror.k[:, 2, :5] = 7.0  # c's context in row 2, every layer
    mirror.v[:, 2, :5] = 8.0
    plan = mirror.plan(_decode((c, 5), (a, 5)), BLOCK)  # b left: c moves from row 2 into row 1
    assert plan is not None and plan.rows.tolist() == [1, 0] and not plan.in_order
    assert plan.num_rows == 2 and plan.refills == ()  # moved, not refilled from the paged cache
    assert bool((mirror.k[:, 1, :5] == 7.0).all()) and bool((mirror.v[:, 1, :5] == 8.0).all())
    assert mirror.copied_positions == 5  # the move's copy, for the step log
    assert plan.mask[:, 0, 0].tolist() == [[True] * 6, [True] * 6]
    d = Seq([6, 7])
    plan = mirror.plan(_decode((a, 6), (c, 6), (d, 3)), BLOCK)
    assert plan is not None and plan.rows.tolist() == [0, 1, 2] and plan.in_order


def test_no_decodes_frees_every_row() -> None:
    mirror, a = _mirror(), Seq([0, 1])
    mirror.plan(_decode((a, 5)), BLOCK)
    assert mirror.plan([], BLOCK) is None
    plan = mirror.plan(_decode((a, 6)), BLOCK)
    assert plan is not None and [row for row, _ in plan.refills] == [0]


def test_over_budget_falls_back_and_frees_the_memory() -> None:
    mirror = _mirror(budget_tokens=8 * 128)  # one allocation unit: 8 rows of 128 positions
    seqs = [Seq(list(range(i * 40, i * 40 + 40))) for i in range(9)]
    assert mirror.plan(_decode(*((s, 100) for s in seqs[:8])), BLOCK) is not None
    assert mirror.capacity == (8, 128)
    assert mirror.plan(_decode(*((s, 101) for s in seqs)), BLOCK) is None  # a ninth row does not fit
    assert mirror.capacity == (0, 0)
    assert mirror.plan(_decode((seqs[0], 200)), BLOCK) is None  # 8 rows x 256 positions do not fit either


def test_growth_keeps_the_rows_contents() -> None:
    mirror, a = _mirror(), Seq(list(range(64)))
    mirror.plan(_decode((a, 5)), BLOCK)
    mirror.k[0, 0, 5] = 7.0
    mirror.plan(_decode((a, 200)), BLOCK)  # longer than the first allocation
    assert mirror.capacity[1] >= 201 and mirror.k[0, 0, 5].tolist() == [[7.0, 7.0]]


def test_the_positions_a_plan_copies_are_counted_for_the_step_log() -> None:
    """Refills copy each new row's context; growing the mirror copies its old rows."""
    mirror, a, b = _mirror(), Seq([0, 1]), Seq([2, 3])
    mirror.plan(_decode((a, 5), (b, 3)), BLOCK)
    assert mirror.copied_positions == 5 + 3  # two refills, the first allocation copies nothing
    mirror.plan(_decode((a, 6), (b, 4)), BLOCK)
    assert mirror.copied_positions == 0  # both extended in place
    rows, length = mirror.capacity
    mirror.plan(_decode((a, length + 1)), BLOCK)  # past the row length: grown, a refilled
    assert mirror.copied_positions == rows * length + length + 1
