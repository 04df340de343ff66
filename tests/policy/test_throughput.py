"""A replica's token throughput measured from the work a saturated pool serves."""

from __future__ import annotations

import numpy as np
import pytest

from tidegate.policy.throughput import PoolSample, SaturatedThroughput

SLOTS = 8


def feed(meter: SaturatedThroughput, start_s: int, end_s: int, tokens_per_replica_s: float, *, ready: int = 2,
         held: int = 2 * SLOTS, queued: int = 3, seed: int = 0) -> None:
    """Ticks of a second; the tokens served arrive in clumps (requests finishing), Poisson around the rate."""
    rng = np.random.default_rng(seed)
    for t in range(start_s, end_s):
        finished = rng.poisson(ready * tokens_per_replica_s / 500)  # requests of 500 tokens
        meter.observe(PoolSample(float(t), ready, held, queued, int(finished * 500)))


def test_saturated_ticks_measure_the_throughput() -> None:
    meter = SaturatedThroughput(SLOTS)
    feed(meter, 0, 300, 1200.0)
    assert meter.tokens_per_s == pytest.approx(1200.0, rel=0.05)


def test_every_slot_held_counts_as_saturated_without_a_queue() -> None:
    meter = SaturatedThroughput(SLOTS)
    feed(meter, 0, 300, 1200.0, queued=0)
    assert meter.tokens_per_s == pytest.approx(1200.0, rel=0.05)


def test_an_unsaturated_pool_teaches_nothing() -> None:
    # half the slots held, serving what arrives: 300 tokens/s a replica, far under what it could
    meter = SaturatedThroughput(SLOTS)
    feed(meter, 0, 300, 300.0, held=SLOTS, queued=0)
    assert meter.tokens_per_s is None
    # interleaved with saturated minutes, the idle ones do not drag the estimate down
    for minute in range(6):
        feed(meter, 300 + 120 * minute, 360 + 120 * minute, 1200.0, seed=minute)
        feed(meter, 360 + 120 * minute, 420 + 120 * minute, 300.0, held=SLOTS, queued=0, seed=minute)
    assert meter.tokens_per_s == pytest.approx(1200.0, rel=0.06)


def test_the_estimate_waits_for_enough_saturated_time() -> None:
    meter = SaturatedThroughput(SLOTS, min_replica_s=60.0)
    feed(meter, 0, 30, 1200.0, ready=1, held=SLOTS)  # 29 replica-seconds (the first tick has no start)
    assert meter.tokens_per_s is None
    feed(meter, 30, 62, 1200.0, ready=1, held=SLOTS)
    assert meter.tokens_per_s is not None


def test_the_estimate_follows_a_change_of_speed() -> None:
    meter = SaturatedThroughput(SLOTS, memory_replica_s=600.0)
    feed(meter, 0, 600, 1200.0)
    feed(meter, 600, 1200, 600.0, seed=1)  # the replicas got slower (a longer request shape, a busier host)
    assert meter.tokens_per_s == pytest.approx(600.0, rel=0.08)
