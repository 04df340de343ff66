"""The pool's fitted TTFT line and each replica's speed against it: exact on exact data, safe with one
size of work, quick to follow a change."""

from __future__ import annotations

import pytest

from tidegate.policy.ttft_model import ReplicaSpeed, TtftFit, pool_line


def _line(speeds: list[ReplicaSpeed]) -> TtftFit:
    fitted = pool_line(speeds)
    assert fitted is not None
    return fitted[0]


def test_no_line_before_the_first_sample() -> None:
    assert pool_line([ReplicaSpeed(), ReplicaSpeed()]) is None


def test_one_size_of_work_gives_the_line_through_the_origin_which_errs_small() -> None:
    only = ReplicaSpeed()
    for _ in range(5):
        only.observe(500, 0.15)  # truly 0.05 + 0.0002 x 500
    line = _line([only])
    assert line.fixed_s == 0.0
    assert line.tokens_within(0.25) < 1000  # the true budget: never overstated


def test_a_replica_that_turns_twice_as_slow_shows_it_within_its_memory() -> None:
    steady, slowed = ReplicaSpeed(memory_samples=16), ReplicaSpeed(memory_samples=16)
    sizes = (100, 400, 900, 200, 1600, 700)
    for i in range(60):
        tokens = sizes[i % len(sizes)]
        steady.observe(tokens, 0.05 + 0.0002 * tokens)
        slowed.observe(tokens, 0.05 + 0.0002 * tokens)
    for i in range(32):
        tokens = sizes[i % len(sizes)]
        steady.observe(tokens, 0.05 + 0.0002 * tokens)
        slowed.observe(tokens, 2 * (0.05 + 0.0002 * tokens))
    fitted = pool_line([steady, slowed], rounds=4)
    assert fitted is not None
    assert fitted[1][1] / fitted[1][0] == pytest.approx(2.0, rel=0.25)


def test_bad_samples_are_refused() -> None:
    with pytest.raises(ValueError):
        ReplicaSpeed().observe(-1, 0.1)
    with pytest.raises(ValueError):
        ReplicaSpeed().observe(10, float("nan"))


def test_the_pool_line_and_each_replicas_speed_from_exact_samples() -> None:
    fast, slow, idle = ReplicaSpeed(), ReplicaSpeed(), ReplicaSpeed()
    for k in range(12):
        tokens = 100 + 80 * k
        fast.observe(tokens, 0.05 + 0.001 * tokens)
        if k % 3 == 0:  # the slow one is sent less: its factor rests on fewer samples
            slow.observe(tokens, 2 * (0.05 + 0.001 * tokens))
    fitted = pool_line([fast, slow, idle], rounds=4)
    assert fitted is not None
    line, factors = fitted
    assert factors[1] / factors[0] == pytest.approx(2.0, rel=1e-3)
    assert factors[2] == 1.0  # no sample yet
    # the factors' sample-weighted mean is 1: the line carries the pool's common speed
    assert factors[0] * fast.samples + factors[1] * slow.samples == pytest.approx(fast.samples + slow.samples)
    assert line.predict_s(500) * factors[0] == pytest.approx(0.55, rel=1e-3)


def test_one_replica_alone_is_the_pools_speed() -> None:
    only = ReplicaSpeed()
    for tokens in (100, 400, 900, 200):
        only.observe(tokens, 0.05 + 0.001 * tokens)
    line, factors = pool_line([only], rounds=4) or (None, ())
    assert factors == (1.0,) and line is not None
    assert line.fixed_s == pytest.approx(0.05) and line.s_per_token == pytest.approx(0.001)
