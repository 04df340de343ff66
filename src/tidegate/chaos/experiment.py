"""An experiment: load against a deployment, and a timeline of faults. Read from YAML (docs/chaos.md).

Every model forbids unknown keys, and a step may only name targets, proxies and partitions the file
declares, so a typo is reported with its location before anything is started.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tidegate.chaos.faults import FaultSet, describe_validation_error

__all__ = ["Experiment", "Step", "ExperimentError", "load_experiment", "parse_experiment", "ACTIONS"]


class ExperimentError(ValueError):
    """An experiment that cannot be run; the message names the file, the key and the reason."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _argv(value: Any) -> Any:
    """A command as a list, or one string split as a shell would."""
    return tuple(shlex.split(value)) if isinstance(value, str) else value


def _pass_is_no_fault(value: Any) -> Any:
    """`pass` (or nothing) is the empty fault set; anything else is validated as a FaultSet, in place."""
    return {} if value is None or value == "pass" else value


def _host_port(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected host:port, got {value!r}")
    return value


class LoadSpec(_Strict):
    """Traffic from the project's load generator (`tidegate bench`), driven in the same process."""

    url: str  # the deployment's base URL, e.g. http://127.0.0.1:8000
    model: str | None = None  # default: the first one /v1/models lists
    endpoint: Literal["chat", "completions"] = "chat"
    stream: bool = True
    arrival: Literal["constant", "poisson"] = "poisson"
    rate: float = Field(10.0, gt=0)  # requests/s
    concurrency: int | None = Field(None, ge=1)  # closed loop instead of arrivals at `rate`
    prompt_tokens: str = "const:64"  # as `tidegate bench --prompt-tokens`
    max_tokens: str = "const:16"
    ignore_eos: bool = False
    api_key: str = ""
    timeout_s: float = Field(30.0, gt=0)  # a request with no complete answer by then counts as hung
    seed: int = 0
    allow_remote_host: bool = False  # load is sent to loopback only unless this is set

    @field_validator("prompt_tokens", "max_tokens")
    @classmethod
    def _length(cls, spec: str) -> str:
        from tidegate.loadgen.mix import parse_length

        parse_length(spec)  # raises ValueError naming the form it expects
        return spec


class GatewaySpec(_Strict):
    """Where to read replica health and load: the gateway's Prometheus page."""

    metrics_url: str  # e.g. http://127.0.0.1:8000/metrics
    api_key: str = ""  # when /metrics is closed to anonymous callers
    pool: str | None = None  # only this pool's replicas
    interval_s: float = Field(0.25, gt=0, le=5)


class MemberSpec(_Strict):
    pid: int | None = Field(None, ge=1)
    port: int | None = Field(None, ge=1, le=65535)  # the process listening on it, looked up at each step
    restart: tuple[str, ...] = ()  # command that starts it again (a list, or one string split as a shell would)
    address: str | None = None  # host:port the gateway names it by; default 127.0.0.1:<port>

    _split_restart = field_validator("restart", mode="before")(_argv)

    @model_validator(mode="after")
    def _one_way_to_find_it(self) -> MemberSpec:
        if (self.pid is None) == (self.port is None):
            raise ValueError("give exactly one of pid, port")
        if self.address is not None:
            _host_port(self.address)
        return self


class ProxySpec(_Strict):
    """A fault proxy the run starts (listen + target), or one already running (admin URL)."""

    listen: str | None = None
    target: str | None = None
    admin: str | None = None  # e.g. http://127.0.0.1:9201, for a `tidegate chaos proxy` already running
    raw_tcp: bool = False
    faults: FaultSet = FaultSet()  # in force from the start

    _faults = field_validator("faults", mode="before")(_pass_is_no_fault)

    @model_validator(mode="after")
    def _started_or_running(self) -> ProxySpec:
        if self.admin is None and (self.listen is None or self.target is None):
            raise ValueError("give listen and target (the run starts the proxy) or admin (one already running)")
        if self.admin is not None and (self.listen is not None or self.target is not None):
            raise ValueError("give either admin or listen and target, not both")
        for value in (self.listen, self.target):
            if value is not None:
                _host_port(value)
        return self


class PartitionSpec(_Strict):
    command: tuple[str, ...] = Field(min_length=1)  # the replica, started inside the namespace
    subnet: str = "10.213.0.0/30"  # this side takes the first address, the replica the second

    _split_command = field_validator("command", mode="before")(_argv)


class KillAction(_Strict):
    target: str
    fraction: float = Field(1.0, gt=0, le=1)


class PauseAction(_Strict):
    target: str
    fraction: float = Field(1.0, gt=0, le=1)
    duration_s: float = Field(gt=0)


class RestartAction(_Strict):
    target: str  # restarts the members this run killed


class ProxyAction(_Strict):
    name: str
    faults: FaultSet

    _faults = field_validator("faults", mode="before")(_pass_is_no_fault)


class CpuPressureAction(_Strict):
    workers: int = Field(1, ge=1, le=256)
    duration_s: float = Field(gt=0)
    near: str | None = None  # a target group: pin to the CPUs its first member may run on


class MemoryPressureAction(_Strict):
    mb: int = Field(ge=1)
    duration_s: float = Field(gt=0)


class PartitionAction(_Strict):
    name: str
    duration_s: float = Field(gt=0)


class KubernetesDeleteAction(_Strict):
    selector: str = Field(min_length=1)  # label selector, e.g. app=vllm
    namespace: str = "default"
    fraction: float = Field(1.0, gt=0, le=1)


Action = Union[KillAction, PauseAction, RestartAction, ProxyAction, CpuPressureAction, MemoryPressureAction,
               PartitionAction, KubernetesDeleteAction]
ACTIONS = ("kill", "pause", "restart", "proxy", "cpu_pressure", "memory_pressure", "partition", "kubernetes_delete")


class Step(_Strict):
    at_s: float = Field(ge=0)  # from the start of the load
    kill: KillAction | None = None
    pause: PauseAction | None = None
    restart: RestartAction | None = None
    proxy: ProxyAction | None = None
    cpu_pressure: CpuPressureAction | None = None
    memory_pressure: MemoryPressureAction | None = None
    partition: PartitionAction | None = None
    kubernetes_delete: KubernetesDeleteAction | None = None

    @model_validator(mode="after")
    def _exactly_one_action(self) -> Step:
        given = [name for name in ACTIONS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"a step does exactly one of {', '.join(ACTIONS)}; this one does "
                             f"{' and '.join(given) or 'none'}")
        return self

    @property
    def action_name(self) -> str:
        return next(name for name in ACTIONS if getattr(self, name) is not None)

    @property
    def action(self) -> Action:
        return getattr(self, self.action_name)


class Experiment(_Strict):
    name: str = "chaos"
    duration_s: float = Field(gt=0)  # of the load; steps happen within it
    tail_s: float = Field(5.0, ge=0)  # keep watching the gateway this long after the load, to see recovery
    load: LoadSpec
    gateway: GatewaySpec | None = None
    targets: dict[str, tuple[MemberSpec, ...]] = {}
    proxies: dict[str, ProxySpec] = {}
    partitions: dict[str, PartitionSpec] = {}
    steps: tuple[Step, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _steps_name_what_is_declared(self) -> Experiment:
        problems = []
        for index, step in enumerate(self.steps):
            where, action = f"steps.{index}.{step.action_name}", step.action
            if step.at_s >= self.duration_s:
                problems.append(f"steps.{index}.at_s: {step.at_s:g} is not within duration_s ({self.duration_s:g})")
            group = getattr(action, "target", None)
            if group is not None and group not in self.targets:
                problems.append(f"{where}.target: no target group {group!r} (declared: {sorted(self.targets)})")
            near = getattr(action, "near", None)
            if near is not None and near not in self.targets:
                problems.append(f"{where}.near: no target group {near!r} (declared: {sorted(self.targets)})")
            if isinstance(action, ProxyAction) and action.name not in self.proxies:
                problems.append(f"{where}.name: no proxy {action.name!r} (declared: {sorted(self.proxies)})")
            if isinstance(action, PartitionAction) and action.name not in self.partitions:
                problems.append(f"{where}.name: no partition {action.name!r} (declared: {sorted(self.partitions)})")
            if isinstance(action, RestartAction) and group in self.targets \
                    and not any(member.restart for member in self.targets[group]):
                problems.append(f"{where}.target: no member of {group!r} has a restart command")
        if problems:
            raise ValueError("; ".join(problems))
        return self


def parse_experiment(text: str, source: str = "<experiment>") -> Experiment:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ExperimentError(f"{source}: not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise ExperimentError(f"{source}: expected a mapping at the top level")
    try:
        return Experiment.model_validate(data)
    except ValidationError as error:
        raise ExperimentError(describe_validation_error(error, f"{source}: experiment")) from None


def load_experiment(path: str | Path) -> Experiment:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ExperimentError(f"{path}: cannot read: {error.strerror}") from None
    return parse_experiment(text, source=str(path))
