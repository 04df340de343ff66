"""A contract fake of the Kubernetes API server, for the actuator's tests: only what the actuator
uses, answered as the real server answers it.

- `GET /apis/apps/v1/namespaces/{ns}/{deployments|statefulsets}/{name}`: the workload, with
  `spec.replicas` and `status.readyReplicas` (ready follows the spec at once, or stays at
  `ready_cap`);
- `GET` and `PUT .../{name}/scale`: an `autoscaling/v1` Scale; a PUT whose
  `metadata.resourceVersion` is not the current one is refused with 409 Conflict (optimistic
  concurrency), a negative or non-integer `spec.replicas` with 422 Invalid; each write bumps the
  resourceVersion;
- 404 for a workload that does not exist, 403 for a namespace listed in `forbidden` (RBAC);
- `inject_conflicts`: that many next PUTs find the scale changed by someone else first.
Errors are `v1` Status objects, as the real server sends them.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_PATH = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/(deployments|statefulsets)/([^/]+)(/scale)?$")
_KINDS = {"deployments": "Deployment", "statefulsets": "StatefulSet"}


@dataclass
class Workload:
    replicas: int
    resource_version: int = 1
    ready_cap: int | None = None  # ready replicas stay at most this (a rollout in progress)


@dataclass
class KubeFake:
    workloads: dict[tuple[str, str, str], Workload] = field(default_factory=dict)  # (namespace, plural, name)
    forbidden: set[str] = field(default_factory=set)
    inject_conflicts: int = 0
    writes: int = 0
    _server: ThreadingHTTPServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> KubeFake:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                fake._answer(self, None)

            def do_PUT(self) -> None:  # noqa: N802
                length = int(self.headers.get("content-length", "0"))
                fake._answer(self, json.loads(self.rfile.read(length) or b"{}"))

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    # ---- the API ---------------------------------------------------------------------------------

    def _answer(self, handler: BaseHTTPRequestHandler, body: dict | None) -> None:
        found = _PATH.match(handler.path.split("?")[0])
        if found is None:
            return self._status(handler, 404, "NotFound", f"no route {handler.path}")
        namespace, plural, name, scale = found.groups()
        if namespace in self.forbidden:
            return self._status(handler, 403, "Forbidden", f'{plural} "{name}" is forbidden: User '
                                f'"system:serviceaccount:{namespace}:default" cannot get resource "{plural}"')
        with self._lock:
            workload = self.workloads.get((namespace, plural, name))
            if workload is None:
                return self._status(handler, 404, "NotFound", f'{plural}.apps "{name}" not found')
            if body is not None:
                if not scale:
                    return self._status(handler, 405, "MethodNotAllowed", "the fake takes PUT on /scale only")
                if self.inject_conflicts > 0:  # someone else wrote first
                    self.inject_conflicts -= 1
                    workload.resource_version += 1
                sent = str(body.get("metadata", {}).get("resourceVersion", ""))
                if sent and sent != str(workload.resource_version):
                    return self._status(handler, 409, "Conflict", f'Operation cannot be fulfilled on {plural}.apps '
                                        f'"{name}": the object has been modified; please apply your changes to '
                                        "the latest version and try again")
                replicas = body.get("spec", {}).get("replicas")
                if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
                    return self._status(handler, 422, "Invalid", f'Scale.autoscaling "{name}" is invalid: '
                                        "spec.replicas: Invalid value: must be greater than or equal to 0")
                workload.replicas = replicas
                workload.resource_version += 1
                self.writes += 1
            document = self._scale(namespace, plural, name, workload) if scale else \
                self._workload(namespace, plural, name, workload)
        self._send(handler, 200, document)

    @staticmethod
    def _ready(workload: Workload) -> int:
        return workload.replicas if workload.ready_cap is None else min(workload.replicas, workload.ready_cap)

    def _scale(self, namespace: str, plural: str, name: str, workload: Workload) -> dict:
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": name, "namespace": namespace, "resourceVersion": str(workload.resource_version)},
                "spec": {"replicas": workload.replicas},
                "status": {"replicas": workload.replicas, "selector": f"app={name}"}}

    def _workload(self, namespace: str, plural: str, name: str, workload: Workload) -> dict:
        labels = {"app": name}
        spec = {"replicas": workload.replicas, "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels},
                             "spec": {"containers": [{"name": name, "image": "vllm/vllm-openai"}]}}}
        if plural == "statefulsets":
            spec["serviceName"] = name
        return {"apiVersion": "apps/v1", "kind": _KINDS[plural],
                "metadata": {"name": name, "namespace": namespace, "resourceVersion": str(workload.resource_version)},
                "spec": spec,
                "status": {"replicas": workload.replicas, "readyReplicas": self._ready(workload)}}

    def _status(self, handler: BaseHTTPRequestHandler, code: int, reason: str, message: str) -> None:
        self._send(handler, code, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                   "message": message, "reason": reason, "code": code})

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, code: int, document: dict) -> None:
        data = json.dumps(document).encode()
        handler.send_response(code)
        handler.send_header("content-type", "application/json")
        handler.send_header("content-length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)
