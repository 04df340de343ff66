"""deploy/kubernetes: every manifest valid against the Kubernetes API schema, offline and strict
(unknown fields fail: the official client's models would drop them silently); the operator's
resources well formed; the gateway's config one `tidegate serve` loads; the PrometheusRule the
generated copy of the alert rules promtool tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tidegate.config import load_config

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.31.0"
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}  # CRDs of the Prometheus Operator: no API schema here


def _documents() -> list[tuple[str, dict]]:
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    return [(name, document) for name in kustomization["resources"]
            for document in yaml.safe_load_all((MANIFESTS / name).read_text()) if document]


def test_the_kustomization_lists_every_manifest_and_its_config() -> None:
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"]) | {f for g in kustomization["configMapGenerator"] for f in g["files"]}
    on_disk = {path.name for path in MANIFESTS.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


@pytest.mark.parametrize(("name", "document"), _documents(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_each_manifest_is_valid_against_the_api_schema(name: str, document: dict) -> None:
    if document["kind"] in OPERATOR_KINDS:
        assert document["apiVersion"] == "monitoring.coreos.com/v1" and document["metadata"]["name"]
        assert set(document["spec"]) <= {"groups", "endpoints", "selector", "jobLabel"}
        return
    kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_the_gateway_serves_what_its_pod_probes_and_exposes() -> None:
    config = load_config(str(MANIFESTS / "serve.yaml"))
    deployment = next(d for _, d in _documents() if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"http": config.server.port, "metrics": config.server.metrics_port}
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["args"][-1] == "/etc/tidegate/serve.yaml"
    # every upstream the pool lists is a pod of the StatefulSet by its stable name, up to the HPA's
    # maximum, which is the autoscaler's; the HPA follows the metric the gateway exports for the pool
    statefulset = next(d for _, d in _documents() if d["kind"] == "StatefulSet")
    hpa = next(d for _, d in _documents() if d["kind"] == "HorizontalPodAutoscaler")
    (pool,) = config.pools
    assert pool.autoscale is not None
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (pool.autoscale.min_replicas,
                                                                        pool.autoscale.max_replicas)
    assert hpa["spec"]["scaleTargetRef"]["name"] == statefulset["metadata"]["name"]
    metric = hpa["spec"]["metrics"][0]["external"]
    assert metric["metric"]["name"] == "tidegate_desired_replicas"
    assert metric["metric"]["selector"]["matchLabels"] == {"pool": pool.name}
    names = {f"http://{statefulset['metadata']['name']}-{i}.{statefulset['spec']['serviceName']}:8000/v1"
             for i in range(pool.autoscale.max_replicas)}
    assert {backend.url for backend in pool.backends} == names


def test_the_prometheus_rule_is_the_generated_copy_of_the_tested_alert_rules() -> None:
    spec = importlib.util.spec_from_file_location("prometheus_rule", MANIFESTS / "prometheus_rule.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (MANIFESTS / "prometheusrule.yaml").read_text() == module.render(), \
        "regenerate: python deploy/kubernetes/prometheus_rule.py > deploy/kubernetes/prometheusrule.yaml"
    alerts = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yaml").read_text())
    assert yaml.safe_load((MANIFESTS / "prometheusrule.yaml").read_text())["spec"]["groups"] == alerts["groups"]


def test_the_image_runs_as_a_user_and_installs_torch_for_the_cpu() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert dockerfile.count("FROM ") == 2 and "USER 10001" in dockerfile
    assert "download.pytorch.org/whl/cpu" in dockerfile
