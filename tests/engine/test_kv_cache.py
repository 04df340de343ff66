"""The KV block manager: capacity in tokens, blocks of 16, usage 0-1."""

from __future__ import annotations

import pytest

from tidegate.engine.kv_cache import BLOCK_SIZE, BlockManager
from tidegate.engine.sequence import SamplingParams, Sequence


def make_seq(seq_id: int = 1) -> Sequence:
    return Sequence(seq_id=seq_id, prompt_token_ids=[1], params=SamplingParams(max_tokens=1))


def test_capacity_is_rounded_down_to_whole_blocks() -> None:
    assert BlockManager(100).num_blocks == 100 // BLOCK_SIZE


def test_grow_allocates_one_block_per_16_tokens() -> None:
    blocks, seq = BlockManager(160), make_seq()
    blocks.grow(seq, 17)
    assert len(seq.block_table) == 2 and blocks.usage == pytest.approx(0.2)


def test_grow_within_the_last_block_takes_nothing_new() -> None:
    blocks, seq = BlockManager(160), make_seq()
    blocks.grow(seq, 10)
    blocks.grow(seq, 16)
    assert len(seq.block_table) == 1


def test_free_returns_every_block() -> None:
    blocks, seq = BlockManager(160), make_seq()
    blocks.grow(seq, 100)
    blocks.free(seq)
    assert seq.block_table == [] and blocks.usage == 0.0


def test_can_hold_says_no_when_blocks_run_out() -> None:
    blocks, first, second = BlockManager(32), make_seq(1), make_seq(2)
    blocks.grow(first, 20)
    assert not blocks.can_hold(second, 1)


def test_growing_past_capacity_raises() -> None:
    blocks = BlockManager(32)
    with pytest.raises(RuntimeError):
        blocks.grow(make_seq(), 33)


def test_sequences_never_share_a_block() -> None:
    blocks, first, second = BlockManager(160), make_seq(1), make_seq(2)
    blocks.grow(first, 40)
    blocks.grow(second, 40)
    assert not set(first.block_table) & set(second.block_table)
