"""The Kubernetes actuator: a Deployment's or StatefulSet's replicas set through its `scale`
subresource with the official client (`pip install 'tidegate[kubernetes]'`), ready replicas read back.

Writes are optimistic: the scale is read, then replaced with the resourceVersion read, so a scale
someone else wrote meanwhile (an operator, another gateway) is not overwritten blindly: on 409 it
is read again and the write retried, a few times. The API's refusals become errors that say what
to fix: 404 (no such workload), 403 (the service account's RBAC), 422 (a value the API refused).

Tested against a contract fake of the API server (tests/control/kube_fake.py: the scale
subresource, resourceVersion conflicts, 404/403/422), and against a real cluster when
`TIDEGATE_K8S_TEST_TARGET` names a workload (tests/control/test_kubernetes_scaler.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = ["WorkloadKind", "ScaleTarget", "ScaleState", "KubernetesScaleError", "KubernetesScaler"]

log = logging.getLogger("tidegate.kubernetes")

CONFLICT_RETRIES = 3


class WorkloadKind(Enum):
    DEPLOYMENT = "Deployment"
    STATEFUL_SET = "StatefulSet"


@dataclass(frozen=True, slots=True)
class ScaleTarget:
    namespace: str
    kind: WorkloadKind
    name: str

    def __str__(self) -> str:
        return f"{self.kind.value} {self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class ScaleState:
    wanted: int  # spec.replicas
    ready: int  # status.readyReplicas


class KubernetesScaleError(RuntimeError):
    """The API refused a read or a write; the message says what to fix."""


class KubernetesScaler:
    def __init__(self, target: ScaleTarget, apps_api: Any | None = None) -> None:
        self.target = target
        if apps_api is None:
            apps_api = _default_apps_api()
        self._api = apps_api

    # ---- reads (they change nothing) -----------------------------------------------------------

    def state(self) -> ScaleState:
        """Replicas the workload is asked for, and ready ones."""
        workload = self._call("read", self._method("read_namespaced_{}"))
        status = workload.status
        return ScaleState(wanted=workload.spec.replicas or 0, ready=(status.ready_replicas or 0) if status else 0)

    # ---- the write ------------------------------------------------------------------------------

    def scale_to(self, replicas: int) -> int:
        """Sets spec.replicas through the scale subresource; returns the replicas written (or found
        already set). Re-reads and retries on 409, up to `CONFLICT_RETRIES` times."""
        from kubernetes.client import V1ObjectMeta, V1Scale, V1ScaleSpec
        from kubernetes.client.exceptions import ApiException

        read = self._method("read_namespaced_{}_scale")
        replace = self._method("replace_namespaced_{}_scale")
        for attempt in range(CONFLICT_RETRIES + 1):
            current = self._call("read", read)
            if current.spec is not None and current.spec.replicas == replicas:
                return replicas
            body = V1Scale(metadata=V1ObjectMeta(name=self.target.name, namespace=self.target.namespace,
                                                 resource_version=current.metadata.resource_version),
                           spec=V1ScaleSpec(replicas=replicas))
            try:
                written = replace(name=self.target.name, namespace=self.target.namespace, body=body)
            except ApiException as error:
                if error.status != 409:
                    raise self._error("write", error) from None
                log.info("scale changed meanwhile; reading it again",
                         extra={"fields": {"target": str(self.target), "attempt": attempt + 1}})
                continue
            log.info("scaled", extra={"fields": {"target": str(self.target), "replicas": replicas}})
            return written.spec.replicas if written.spec is not None else replicas
        raise KubernetesScaleError(f"{self.target}: the scale kept changing under us (409 {CONFLICT_RETRIES + 1} "
                                   "times in a row): another controller (an HPA?) writes it too")

    # ---- internals -------------------------------------------------------------------------------

    def _method(self, pattern: str) -> Any:
        return getattr(self._api, pattern.format("deployment" if self.target.kind is WorkloadKind.DEPLOYMENT
                                                  else "stateful_set"))

    def _call(self, verb: str, method: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            return method(name=self.target.name, namespace=self.target.namespace)
        except ApiException as error:
            raise self._error(verb, error) from None

    def _error(self, verb: str, error: Any) -> KubernetesScaleError:
        target, status = self.target, error.status
        resource = "deployments" if target.kind is WorkloadKind.DEPLOYMENT else "statefulsets"
        if status == 404:
            return KubernetesScaleError(f"{target} not found: check autoscale.kubernetes (namespace, kind, name)")
        if status in (401, 403):
            return KubernetesScaleError(
                f"{target}: the API refused to {verb} it ({status}): the gateway's service account needs "
                f"'get' on {resource} and 'get', 'update' on {resource}/scale in namespace {target.namespace} "
                "(a Role and RoleBinding)")
        if status == 422:
            return KubernetesScaleError(f"{target}: the API refused the scale as invalid (422): {error.body}")
        return KubernetesScaleError(f"{target}: {verb} failed with {status}: {error.reason}")


def _default_apps_api() -> Any:
    """In a pod: its service account; elsewhere: the kubeconfig."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise KubernetesScaleError("autoscale.kubernetes needs the official client: pip install 'tidegate[kubernetes]'") \
            from None

    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as error:
            raise KubernetesScaleError(f"autoscale.kubernetes: no service account (not in a pod) and no usable "
                                       f"kubeconfig: {error}") from None
    return client.AppsV1Api()
