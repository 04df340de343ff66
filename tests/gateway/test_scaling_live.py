"""The autoscaler in a running gateway: desired replicas rise under load past the ready fleet and
fall back after it, exported as tidegate_desired_replicas beside tidegate_replicas_ready, with the
decisions on the status page. The pool lists three backends of which one runs (the others are
replicas an actuator has not started: not ready)."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gateway_harness import StreamingLoad, wait_for  # noqa: E402
from support import ManagedProcess, free_port, start_process, tidegate_argv  # noqa: E402


def _gauges(url: str, name: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {sample.labels["pool"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == name}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    processes: list[ManagedProcess] = []
    try:
        mock = free_port()
        processes.append(start_process(tidegate_argv("mock-upstream", "--port", str(mock), "--tokens", "8",
                                                     "--ttft-ms", "400", "--itl-ms", "20"),
                                       ready_url=f"http://127.0.0.1:{mock}/health", timeout_s=30))
        port = free_port()
        backends = [{"type": "upstream", "url": f"http://127.0.0.1:{p}/v1", "slot_limit": 2}
                    for p in (mock, free_port(), free_port())]
        config = {"server": {"port": port, "access_log": False},
                  "health": {"interval_s": 0.5},
                  "pools": [{"name": "m", "backends": backends,
                             "autoscale": {"min_replicas": 1, "max_replicas": 3, "tick_s": 0.5,
                                           "stable_window_s": 2, "panic_window_s": 1, "scale_down_window_s": 2}}]}
        path = tmp_path_factory.mktemp("scaling") / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        processes.append(start_process(tidegate_argv("serve", "--config", str(path)),
                                       ready_url=f"http://127.0.0.1:{port}/ready", timeout_s=30))
        yield f"http://127.0.0.1:{port}"
    finally:
        for process in reversed(processes):
            process.stop()


def test_desired_replicas_rise_under_load_and_fall_after_it(gateway: str) -> None:
    assert wait_for(lambda: _gauges(gateway, "tidegate_replicas_ready").get("m") == 1.0, 10)
    assert _gauges(gateway, "tidegate_desired_replicas")["m"] == 1.0  # idle: the minimum
    with StreamingLoad(gateway, "m", clients=8, duration_s=6.0):
        # eight clients on one ready replica of two slots: demand 8 over 2 x 0.7 asks for the maximum
        assert wait_for(lambda: _gauges(gateway, "tidegate_desired_replicas")["m"] == 3.0, 6), \
            _gauges(gateway, "tidegate_desired_replicas")
        assert _gauges(gateway, "tidegate_replicas_ready")["m"] == 1.0
    assert wait_for(lambda: _gauges(gateway, "tidegate_desired_replicas")["m"] == 1.0, 15)  # scaled in after its window
    with urllib.request.urlopen(f"{gateway}/metrics", timeout=10) as response:
        work = {sample.labels["kind"]: sample.value for family in text_string_to_metric_families(response.read().decode())
                for sample in family.samples
                if sample.name == "tidegate_overload_work_tokens_total" and sample.labels["pool"] == "m"}
    assert work["prompt"] > 0 and work["output"] > 0, work  # the work the load brought, for work demand
    with urllib.request.urlopen(f"{gateway}/status.json", timeout=10) as response:
        decisions = json.loads(response.read())["pools"][0]["scaling"]
    assert [d["desired"] for d in decisions][:1] == [1] and any(d["desired"] == 3 for d in decisions), decisions


def _health(gateway: str) -> list[str]:
    with urllib.request.urlopen(f"{gateway}/status.json", timeout=10) as response:
        return [replica["health"] for replica in json.loads(response.read())["pools"][0]["replicas"]]


def test_the_gateway_writes_the_desired_count_to_a_kubernetes_workload(tmp_path: Path) -> None:
    """`autoscale.kubernetes`: the gateway scales a StatefulSet through the API (here the contract
    fake of tests/control/kube_fake.py, reached through a kubeconfig) as its desired count moves, one
    pod more as a warm standby. Its three pods are the pool's backends in ordinal order (three mock
    upstreams that stay up: the fake starts no pod), so the gateway keeps the pods past those serving
    out of traffic, promotes the standby at once, and drains a pod before a scale-in removes it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "control"))
    from kube_fake import KubeFake, Workload

    api = KubeFake(workloads={("serving", "statefulsets", "vllm"): Workload(1)}).start()
    processes: list[ManagedProcess] = []
    try:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
            "users": [{"name": "gateway", "user": {"token": "unused"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "gateway"}}]}))
        mocks = [free_port() for _ in range(3)]
        for mock in mocks:
            processes.append(start_process(tidegate_argv("mock-upstream", "--port", str(mock), "--tokens", "8",
                                                         "--ttft-ms", "400", "--itl-ms", "20"),
                                           ready_url=f"http://127.0.0.1:{mock}/health", timeout_s=30))
        port = free_port()
        config = {"server": {"port": port, "access_log": False}, "health": {"interval_s": 0.5},
                  "pools": [{"name": "m", "backends": [{"type": "upstream", "url": f"http://127.0.0.1:{mock}/v1",
                                                        "slot_limit": 2} for mock in mocks],
                             "autoscale": {"min_replicas": 1, "max_replicas": 2, "standby": 1, "tick_s": 0.5,
                                           "stable_window_s": 2, "panic_window_s": 1, "scale_down_window_s": 2,
                                           "kubernetes": {"namespace": "serving", "kind": "StatefulSet",
                                                          "name": "vllm"}}}]}
        (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(config))
        env = {"KUBECONFIG": str(kubeconfig), "KUBERNETES_SERVICE_HOST": ""}
        processes.append(start_process(tidegate_argv("serve", "--config", str(tmp_path / "gateway.yaml")),
                                       ready_url=f"http://127.0.0.1:{port}/ready", timeout_s=30, env=env))
        gateway = f"http://127.0.0.1:{port}"
        workload = api.workloads[("serving", "statefulsets", "vllm")]
        # the workload's one pod serves, the next is asked for as the standby; the last answers its
        # checks but is no pod of the workload yet
        assert wait_for(lambda: _health(gateway) == ["healthy", "standby", "stopped"], 8), _health(gateway)
        assert wait_for(lambda: workload.replicas == 2, 5), workload
        with StreamingLoad(gateway, "m", clients=8, duration_s=5.0):
            # the standby takes traffic and the last pod is asked for as the next standby
            assert wait_for(lambda: _health(gateway) == ["healthy", "healthy", "standby"], 8), _health(gateway)
            assert wait_for(lambda: workload.replicas == 3, 5), workload
        # scaled in after its window: pod 1 drained and kept as the standby, pod 2 removed
        assert wait_for(lambda: workload.replicas == 2, 15), workload
        # the health follows once the write's answer is back (the count is written first)
        assert wait_for(lambda: _health(gateway) == ["healthy", "standby", "stopped"], 5), _health(gateway)
        assert api.writes >= 3
        with StreamingLoad(gateway, "m", clients=2) as load:
            time.sleep(2.0)
        assert load.answered and not load.failed, load.failed  # the pod left serves alone
    finally:
        for process in reversed(processes):
            process.stop()
        api.stop()
