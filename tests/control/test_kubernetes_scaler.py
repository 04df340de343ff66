"""The Kubernetes actuator with the official `kubernetes` client, against the contract fake of the
API server (kube_fake.py) and, opt-in, a real cluster: `TIDEGATE_K8S_TEST_TARGET=namespace/Kind/name`
with a kubeconfig (`KUBECONFIG`) whose user may scale that workload (it is scaled up by one and back)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kube_fake import KubeFake, Workload  # noqa: E402

from tidegate.control.kubernetes_scaler import (KubernetesScaleError, KubernetesScaler, ScaleTarget,  # noqa: E402
                                                WorkloadKind)

VLLM = ScaleTarget("serving", WorkloadKind.STATEFUL_SET, "vllm")
GATEWAY = ScaleTarget("serving", WorkloadKind.DEPLOYMENT, "tidegate-gateway")


@pytest.fixture()
def fake() -> Iterator[KubeFake]:
    server = KubeFake(workloads={("serving", "statefulsets", "vllm"): Workload(2),
                                 ("serving", "deployments", "tidegate-gateway"): Workload(2)},
                      forbidden={"locked"}).start()
    try:
        yield server
    finally:
        server.stop()


def _scaler(fake: KubeFake, target: ScaleTarget) -> KubernetesScaler:
    configuration = client.Configuration(host=fake.url)
    return KubernetesScaler(target, client.AppsV1Api(client.ApiClient(configuration)))


@pytest.mark.parametrize("target", [VLLM, GATEWAY], ids=str)
def test_scales_through_the_scale_subresource_and_reads_ready_replicas_back(fake: KubeFake,
                                                                           target: ScaleTarget) -> None:
    scaler = _scaler(fake, target)
    assert scaler.state().wanted == 2
    assert scaler.scale_to(4) == 4
    state = scaler.state()
    assert (state.wanted, state.ready) == (4, 4) and fake.writes == 1


def test_ready_replicas_are_what_the_workload_reports_not_what_was_asked(fake: KubeFake) -> None:
    fake.workloads[("serving", "statefulsets", "vllm")].ready_cap = 2  # the new pods are still loading
    scaler = _scaler(fake, VLLM)
    scaler.scale_to(4)
    state = scaler.state()
    assert (state.wanted, state.ready) == (4, 2)


def test_the_same_count_writes_nothing(fake: KubeFake) -> None:
    assert _scaler(fake, VLLM).scale_to(2) == 2 and fake.writes == 0


def test_a_conflict_reads_the_scale_again_and_retries(fake: KubeFake) -> None:
    fake.inject_conflicts = 2  # someone else wrote the scale twice meanwhile
    assert _scaler(fake, VLLM).scale_to(3) == 3
    assert fake.writes == 1 and fake.workloads[("serving", "statefulsets", "vllm")].replicas == 3


def test_a_scale_that_keeps_changing_is_an_error_not_a_loop(fake: KubeFake) -> None:
    fake.inject_conflicts = 10
    with pytest.raises(KubernetesScaleError, match="kept changing"):
        _scaler(fake, VLLM).scale_to(3)


def test_a_missing_workload_names_what_to_check(fake: KubeFake) -> None:
    with pytest.raises(KubernetesScaleError, match=r"StatefulSet serving/vlm not found: check autoscale\.kubernetes"):
        _scaler(fake, ScaleTarget("serving", WorkloadKind.STATEFUL_SET, "vlm")).scale_to(3)


def test_rbac_refusal_says_which_permissions_the_service_account_needs(fake: KubeFake) -> None:
    with pytest.raises(KubernetesScaleError, match=r"needs 'get' on statefulsets and 'get', 'update' on "
                                                   r"statefulsets/scale in namespace locked"):
        _scaler(fake, ScaleTarget("locked", WorkloadKind.STATEFUL_SET, "vllm")).scale_to(3)


def test_an_invalid_count_is_the_apis_422(fake: KubeFake) -> None:
    with pytest.raises(KubernetesScaleError, match=r"invalid \(422\)"):
        _scaler(fake, VLLM).scale_to(-1)


@pytest.mark.skipif(not os.environ.get("TIDEGATE_K8S_TEST_TARGET"),
                    reason="opt-in: TIDEGATE_K8S_TEST_TARGET=namespace/Kind/name and a kubeconfig")
def test_the_same_contract_on_a_real_cluster() -> None:
    namespace, kind, name = os.environ["TIDEGATE_K8S_TEST_TARGET"].split("/")
    scaler = KubernetesScaler(ScaleTarget(namespace, WorkloadKind(kind), name))
    before = scaler.state().wanted
    try:
        assert scaler.scale_to(before + 1) == before + 1
        assert scaler.state().wanted == before + 1
    finally:
        assert scaler.scale_to(before) == before
    with pytest.raises(KubernetesScaleError, match="not found"):
        KubernetesScaler(ScaleTarget(namespace, WorkloadKind(kind), name + "-does-not-exist")).state()


def test_no_service_account_and_no_kubeconfig_is_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubernetesScaleError, match="no service account .* and no usable kubeconfig"):
        KubernetesScaler(VLLM)
