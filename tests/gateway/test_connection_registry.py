"""The connection registry's sweep and cap on stand-in connections, with a clock the test moves."""

from __future__ import annotations

import logging

import pytest

from tidegate.gateway.connections import IDLE, READING_BODY, READING_HEAD, ConnectionLimits, ConnectionRegistry
from tidegate.telemetry.metrics import GatewayMetrics


class FakeConnection:
    def __init__(self) -> None:
        self.phase = IDLE
        self.phase_since = 0.0
        self.handling = False
        self.timed_out: bool | None = None  # the `answer` it was timed out with
        self.refused: bool | None = None

    def time_out(self, answer: bool, linger: bool) -> bool:
        self.timed_out = answer
        return True

    def refuse(self, linger: bool) -> None:
        self.refused = linger

    def abort(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _registry(clock: Clock, max_connections: int = 100, metrics: GatewayMetrics | None = None) -> ConnectionRegistry:
    return ConnectionRegistry(ConnectionLimits(keepalive_timeout_s=10, head_timeout_s=5, body_timeout_s=20,
                                               max_connections=max_connections), metrics, clock=clock)


def _sweep_at(registry: ConnectionRegistry, clock: Clock, now: float) -> None:
    clock.now = now
    registry.sweep()


def test_each_phase_times_out_after_its_own_limit_and_never_early(clock: Clock) -> None:
    registry = _registry(clock)
    idle, head, body = FakeConnection(), FakeConnection(), FakeConnection()
    head.phase, body.phase = READING_HEAD, READING_BODY
    for conn in (idle, head, body):
        assert registry.admit(conn)
    _sweep_at(registry, clock, 1000.0)  # stamps them all
    _sweep_at(registry, clock, 1005.0)
    assert head.timed_out is None  # 5 s is not past the 5 s limit
    _sweep_at(registry, clock, 1005.5)
    assert head.timed_out is True and idle.timed_out is None
    _sweep_at(registry, clock, 1010.5)
    assert idle.timed_out is False  # idle: closed without an answer
    assert body.timed_out is None
    _sweep_at(registry, clock, 1020.5)
    assert body.timed_out is True
    assert len(registry) == 0


def test_a_connection_being_handled_is_never_timed_out(clock: Clock) -> None:
    registry = _registry(clock)
    conn = FakeConnection()
    registry.admit(conn)
    conn.handling = True
    for second in range(100):
        _sweep_at(registry, clock, 1000.0 + second)
    assert conn.timed_out is None


def test_a_new_phase_starts_its_clock_again(clock: Clock) -> None:
    registry = _registry(clock)
    conn = FakeConnection()
    registry.admit(conn)
    _sweep_at(registry, clock, 1000.0)
    _sweep_at(registry, clock, 1009.0)
    conn.phase, conn.phase_since = READING_HEAD, 0.0  # what HttpConnection does when a request begins
    _sweep_at(registry, clock, 1011.0)
    _sweep_at(registry, clock, 1015.0)
    assert conn.timed_out is None
    _sweep_at(registry, clock, 1016.5)
    assert conn.timed_out is True


def test_at_the_cap_the_longest_idle_connection_makes_room(clock: Clock) -> None:
    registry = _registry(clock, max_connections=3)
    busy, idle_long, idle_short = FakeConnection(), FakeConnection(), FakeConnection()
    busy.phase = READING_HEAD
    for conn in (busy, idle_short, idle_long):
        registry.admit(conn)
    idle_long.phase_since, idle_short.phase_since = 1000.0, 1003.0
    newcomer = FakeConnection()
    assert registry.admit(newcomer)
    assert idle_long.timed_out is False and idle_short.timed_out is None and busy.timed_out is None
    assert newcomer.refused is None and len(registry) == 3


def test_at_the_cap_with_none_idle_a_new_connection_is_refused(clock: Clock) -> None:
    metrics = GatewayMetrics()
    registry = _registry(clock, max_connections=2, metrics=metrics)
    for _ in range(2):
        conn = FakeConnection()
        conn.phase = READING_BODY
        registry.admit(conn)
    refused = FakeConnection()
    assert not registry.admit(refused)
    assert refused.refused is True  # lingers to drain the client's request
    assert len(registry) == 2
    text = metrics.render().decode()
    assert 'tidegate_client_connections_closed_total{reason="over_capacity"} 1.0' in text
    assert "tidegate_client_connections_open 2.0" in text


def test_closes_are_logged_once_per_reason_per_window(clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    registry = _registry(clock, max_connections=1)
    busy = FakeConnection()
    busy.handling = True
    registry.admit(busy)
    with caplog.at_level(logging.WARNING, logger="tidegate.gateway"):
        for _ in range(50):
            registry.admit(FakeConnection())  # 50 refusals
        _sweep_at(registry, clock, 1000.0)
        for _ in range(7):
            registry.admit(FakeConnection())
        _sweep_at(registry, clock, 1001.0)  # within 10 s: not logged yet
        _sweep_at(registry, clock, 1010.0)
        registry.admit(FakeConnection())
        registry.stop()  # logs what the rate limit held back
    lines = [record for record in caplog.records if record.getMessage() == "client connections closed"]
    assert [(r.fields["reason"], r.fields["count"]) for r in lines] == [("over_capacity", 50), ("over_capacity", 7),
                                                                        ("over_capacity", 1)]
