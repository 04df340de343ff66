"""The Kubernetes actuator drains a StatefulSet's highest ordinals before it writes a lower count, so
a scale-in cuts no request: the real `kubernetes` client against the contract fake of the API server
(tests/control/kube_fake.py); the replicas stand for the pool's backends, pod i as backend i."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubernetes import client

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "control"))

from kube_fake import KubeFake, Workload  # noqa: E402

from tidegate.control.kubernetes_scaler import KubernetesScaler, ScaleTarget, WorkloadKind  # noqa: E402
from tidegate.gateway.kubernetes_actuator import KubernetesActuator  # noqa: E402
from tidegate.types import ReplicaHealth as H  # noqa: E402

KEY = ("serving", "statefulsets", "vllm")


@dataclass
class Backend:
    replica_id: str
    health: H = H.HEALTHY
    outstanding: int = 0


@pytest.fixture()
def fake() -> Iterator[KubeFake]:
    server = KubeFake(workloads={KEY: Workload(3)}).start()
    try:
        yield server
    finally:
        server.stop()


def _actuator(fake: KubeFake, backends: list[Backend] | None, wakes: list[int], standby: int = 0
              ) -> KubernetesActuator:
    scaler = KubernetesScaler(ScaleTarget("serving", WorkloadKind.STATEFUL_SET, "vllm"),
                              client.AppsV1Api(client.ApiClient(client.Configuration(host=fake.url))))
    return KubernetesActuator(scaler, ordinals=backends, wake=lambda: wakes.append(1), standby=standby,
                              drain_timeout_s=30.0)


async def _settle(actuator: KubernetesActuator, desired: int, until, timeout_s: float = 10.0) -> None:
    """Applies `desired` as the scale loop does, a tick at a time, until `until()` holds."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not until():
        assert asyncio.get_running_loop().time() < deadline, "not settled in time"
        actuator.apply(desired)
        await asyncio.sleep(0.02)


def test_a_scale_in_drains_the_highest_ordinals_before_it_writes_the_count(fake: KubeFake) -> None:
    backends = [Backend(f"vllm-{i}") for i in range(4)]
    wakes: list[int] = []
    workload = fake.workloads[KEY]

    async def scenario() -> None:
        actuator = _actuator(fake, backends, wakes)
        # first the count the workload has: the listed pod past it is stopped, nothing written
        await _settle(actuator, 1, lambda: backends[3].health is H.STOPPED)
        assert fake.writes == 0 and [b.health for b in backends[:3]] == [H.HEALTHY] * 3
        backends[2].outstanding = 1  # a request still on pod 2
        actuator.apply(1)
        await asyncio.sleep(0.5)
        assert [b.health for b in backends[1:3]] == [H.DRAINING, H.DRAINING]  # out of traffic at once
        assert workload.replicas == 3 and fake.writes == 0  # its pod must outlive the request
        backends[2].outstanding = 0
        await _settle(actuator, 1, lambda: workload.replicas == 1)
        await _settle(actuator, 1, lambda: backends[2].health is H.STOPPED)
        assert [b.health for b in backends] == [H.HEALTHY, H.STOPPED, H.STOPPED, H.STOPPED]
        assert wakes  # the pool's dispatch heard of each change of health
        # a scale-out asks for the pods again: their health checks take them in as they answer
        await _settle(actuator, 3, lambda: workload.replicas == 3)
        assert [b.health for b in backends] == [H.HEALTHY, H.UNKNOWN, H.UNKNOWN, H.STOPPED]

    asyncio.run(scenario())


def test_a_standby_pod_takes_traffic_at_once_and_a_drained_pod_becomes_the_standby(fake: KubeFake) -> None:
    backends = [Backend(f"vllm-{i}") for i in range(4)]
    workload = fake.workloads[KEY]
    workload.replicas = 2

    async def scenario() -> None:
        actuator = _actuator(fake, backends, [], standby=1)
        await _settle(actuator, 2, lambda: actuator._written == 2)
        # two serve; the count grows by the standby's pod, which loads out of traffic
        await _settle(actuator, 2, lambda: workload.replicas == 3)
        assert [b.health for b in backends] == [H.HEALTHY, H.HEALTHY, H.WARMING, H.STOPPED]
        backends[2].health = H.STANDBY  # its pod answered its health check (the checker's move)
        actuator.apply(3)  # a scale-out: the standby serves now, before any write returns
        assert backends[2].health is H.HEALTHY and actuator.starting() == 0
        await _settle(actuator, 3, lambda: workload.replicas == 4)  # and the next pod refills the standby
        assert backends[3].health is H.WARMING
        backends[3].health = H.STANDBY
        # a scale-in: pod 2 drains and is kept as the standby; pod 3, the standby before, ends
        backends[2].outstanding = 1
        actuator.apply(2)
        await asyncio.sleep(0.3)
        assert backends[2].health is H.DRAINING and workload.replicas == 4
        backends[2].outstanding = 0
        await _settle(actuator, 2, lambda: workload.replicas == 3 and backends[3].health is H.STOPPED)
        assert [b.health for b in backends] == [H.HEALTHY, H.HEALTHY, H.STANDBY, H.STOPPED]

    asyncio.run(scenario())


def test_a_scale_out_calls_off_a_drain_not_yet_written(fake: KubeFake) -> None:
    backends = [Backend(f"vllm-{i}") for i in range(3)]
    workload = fake.workloads[KEY]

    async def scenario() -> None:
        actuator = _actuator(fake, backends, [])
        await _settle(actuator, 3, lambda: actuator._written == 3)
        backends[2].outstanding = 1  # a long stream holds the drain
        actuator.apply(2)
        await asyncio.sleep(0.2)
        assert backends[2].health is H.DRAINING
        actuator.apply(3)  # a surge: the pod still runs, so it serves again at once, before any write
        assert backends[2].health is H.HEALTHY
        for _ in range(10):
            actuator.apply(3)
            await asyncio.sleep(0.02)
        assert workload.replicas == 3 and fake.writes == 0 and backends[2].health is H.HEALTHY

    asyncio.run(scenario())


def test_a_refused_write_puts_the_drained_pods_back_in_traffic(fake: KubeFake) -> None:
    backends = [Backend(f"vllm-{i}") for i in range(3)]

    async def scenario() -> None:
        actuator = _actuator(fake, backends, [])
        await _settle(actuator, 3, lambda: actuator._written == 3)
        fake.forbidden.add("serving")  # RBAC withdrawn: the write is refused
        actuator.apply(2)
        await _settle(actuator, 2, lambda: backends[2].health is H.UNKNOWN)
        assert fake.workloads[KEY].replicas == 3  # the count stands, and so does the pod
        for _ in range(10):  # the next ticks leave it in traffic rather than drain it again and again
            actuator.apply(2)
            await asyncio.sleep(0.02)
        assert backends[2].health is H.UNKNOWN

    asyncio.run(scenario())


def test_without_ordinals_the_count_is_written_as_decided(fake: KubeFake) -> None:
    async def scenario() -> None:
        actuator = _actuator(fake, None, [])
        await _settle(actuator, 1, lambda: fake.workloads[KEY].replicas == 1)
        assert fake.writes == 1

    asyncio.run(scenario())
