"""Warm spares (gateway/spares.py): a dead worker leaves traffic at once and a loaded spare takes it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tidegate.config import ConfigError, parse_config
from tidegate.gateway.spares import replace_dead_worker
from tidegate.types import ReplicaHealth as H


@dataclass
class _Replica:
    replica_id: str
    health: H


def _pool(*healths: H) -> list[_Replica]:
    return [_Replica(f"r{i}", health) for i, health in enumerate(healths)]


def test_a_loaded_spare_takes_the_dead_workers_traffic_and_the_dead_one_loads_as_the_next_spare() -> None:
    pool = _pool(H.HEALTHY, H.HEALTHY, H.STANDBY)
    assert replace_dead_worker(pool, "r0")
    assert [r.health for r in pool] == [H.WARMING, H.HEALTHY, H.HEALTHY]


def test_with_no_spare_loaded_the_dead_worker_leaves_traffic_until_it_answers_again() -> None:
    pool = _pool(H.HEALTHY, H.WARMING)
    assert replace_dead_worker(pool, "r0")
    assert [r.health for r in pool] == [H.UNKNOWN, H.WARMING]


def test_a_dead_spare_loads_again_and_changes_no_traffic() -> None:
    pool = _pool(H.HEALTHY, H.STANDBY)
    assert not replace_dead_worker(pool, "r1")
    assert [r.health for r in pool] == [H.HEALTHY, H.WARMING]


def test_a_worker_an_actuator_is_stopping_is_left_to_it() -> None:
    pool = _pool(H.DRAINING, H.STANDBY)
    assert not replace_dead_worker(pool, "r0")
    assert [r.health for r in pool] == [H.DRAINING, H.STANDBY]


def _config(spare: int, backends: str = "      - {type: embedded, model: m, count: 2}", extra: str = "") -> str:
    return f"pools:\n  - name: p\n    spare: {spare}\n{extra}    backends:\n{backends}\n"


def test_spare_parses_for_an_embedded_pool() -> None:
    assert parse_config(_config(1), environ={}).pools[0].spare == 1


@pytest.mark.parametrize("text", [
    _config(2),  # leaves none to serve
    _config(1, "      - {type: upstream, url: 'http://127.0.0.1:9/v1'}\n      - {type: embedded, model: m, count: 2}"),
    _config(1, extra="    autoscale: {min_replicas: 1, max_replicas: 1}\n"),
])
def test_spare_is_refused_where_it_cannot_work(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_config(text, environ={})


def test_a_gateway_loads_its_spares_out_of_traffic_and_hears_of_worker_exits() -> None:
    from tidegate.gateway.app import Gateway

    gateway = Gateway(parse_config(_config(1, "      - {type: embedded, model: m, count: 3}"), environ={}))
    replicas = gateway.pools["p"].replicas
    assert [r.health for r in replicas] == [H.UNKNOWN, H.UNKNOWN, H.WARMING]
    assert gateway.supervisor.on_exit is not None
    replicas[0].health, replicas[2].health = H.HEALTHY, H.STANDBY
    gateway.supervisor.on_exit(replicas[0].replica_id)
    assert [r.health for r in replicas] == [H.WARMING, H.UNKNOWN, H.HEALTHY]


def test_a_failed_request_to_a_dead_worker_promotes_the_spare_before_the_exit_is_reported() -> None:
    from tidegate.gateway.app import Gateway

    gateway = Gateway(parse_config(_config(1), environ={}))
    pool = gateway.pools["p"]
    serving, spare = pool.replicas
    serving.health, spare.health = H.HEALTHY, H.STANDBY
    assert pool.on_replica_failed is not None
    gateway.supervisor.exited = lambda name: False  # type: ignore[method-assign]
    pool.on_replica_failed(serving)  # a failure of a live worker changes nothing here
    assert [serving.health, spare.health] == [H.HEALTHY, H.STANDBY]
    gateway.supervisor.exited = lambda name: name == serving.replica_id  # type: ignore[method-assign]
    pool.on_replica_failed(serving)
    assert [serving.health, spare.health] == [H.WARMING, H.HEALTHY]
    gateway.supervisor.on_exit(serving.replica_id)  # the exit, reported after: nothing more changes
    assert [serving.health, spare.health] == [H.WARMING, H.HEALTHY]
