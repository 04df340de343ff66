"""Network partitions with Linux network namespaces: a replica runs in a namespace of its own, joined to
this one by a veth pair; a partition takes the namespace's end of the pair down, so packets to and
from the replica are dropped in silence (connects and reads time out, as across a real partition,
rather than being refused), and healing brings it up again.

Needs root and a working `ip netns`; `unavailable_reason()` says why not, and the experiment runner
then skips the partition with that message instead of failing.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import shutil
import subprocess
from dataclasses import dataclass, field

from tidegate.chaos.process_faults import FaultResult, Outcome

__all__ = ["NetnsReplica", "unavailable_reason"]


def unavailable_reason() -> str | None:
    """None where partitions can be made here; otherwise why not, for the user."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network partitions need root (they create network namespaces and veth links)"
    if shutil.which("ip") is None:
        return "network partitions need the `ip` command (iproute2)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip() or f'exit {probe.returncode}'}"
    return None


def _ip(*args: str, namespace: str | None = None) -> None:
    argv = ["ip", "netns", "exec", namespace, "ip", *args] if namespace else ["ip", *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise OSError(f"{' '.join(argv)}: {done.stderr.strip() or f'exit {done.returncode}'}")


@dataclass
class NetnsReplica:
    """A command run inside namespace `tgc-<name>`, reachable from here at `replica_ip` (subnet's 2nd host)."""

    name: str
    command: tuple[str, ...]
    subnet: str  # e.g. 10.213.7.0/30: the host side takes the first address, the replica the second
    process: subprocess.Popen | None = None
    _created: list[str] = field(default_factory=list)  # what setup made, undone by teardown

    def __post_init__(self) -> None:
        network = ipaddress.ip_network(self.subnet)
        hosts = list(network.hosts())[:2]
        if len(hosts) < 2:
            raise ValueError(f"partition {self.name}: subnet {self.subnet} has room for fewer than two hosts")
        self.host_ip, self.replica_ip, self.prefix = str(hosts[0]), str(hosts[1]), network.prefixlen
        # interface names are at most 15 characters: a short digest of the name keeps them unique
        digest = hashlib.sha1(self.name.encode()).hexdigest()[:8]
        self.namespace, self.host_link, self.replica_link = f"tgc-{digest}", f"tgc{digest}h", f"tgc{digest}r"

    def setup(self, log_path: str | None = None) -> FaultResult:
        """Creates the namespace and link and starts the command in it. Blocking (runs `ip`)."""
        try:
            _ip("netns", "add", self.namespace)
            self._created.append("netns")
            _ip("link", "add", self.host_link, "type", "veth", "peer", "name", self.replica_link)
            self._created.append("link")
            _ip("link", "set", self.replica_link, "netns", self.namespace)
            _ip("addr", "add", f"{self.host_ip}/{self.prefix}", "dev", self.host_link)
            _ip("link", "set", self.host_link, "up")
            _ip("addr", "add", f"{self.replica_ip}/{self.prefix}", "dev", self.replica_link, namespace=self.namespace)
            _ip("link", "set", self.replica_link, "up", namespace=self.namespace)
            _ip("link", "set", "lo", "up", namespace=self.namespace)
        except (OSError, subprocess.TimeoutExpired) as error:
            self.teardown()
            return FaultResult(Outcome.FAILED, f"partition {self.name}: {error}")
        log = open(log_path, "ab") if log_path else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(["ip", "netns", "exec", self.namespace, *self.command], stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            if log_path:
                log.close()  # type: ignore[union-attr]
        return FaultResult(Outcome.APPLIED, f"{self.name}: started in namespace {self.namespace} at "
                                            f"{self.replica_ip} (pid {self.process.pid})", (self.process.pid,))

    def cut(self) -> FaultResult:
        return self._set_link("down", "partitioned: packets to and from it are dropped")

    def heal(self) -> FaultResult:
        return self._set_link("up", "healed")

    def _set_link(self, state: str, what: str) -> FaultResult:
        try:
            _ip("link", "set", self.replica_link, state, namespace=self.namespace)
        except (OSError, subprocess.TimeoutExpired) as error:
            return FaultResult(Outcome.FAILED, f"{self.name}: {error}")
        return FaultResult(Outcome.APPLIED, f"{self.name} ({self.replica_ip}) {what}")

    def teardown(self) -> None:
        """Stops the command and removes what setup made; safe to call twice."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        if "link" in self._created:  # deleting one end of a veth pair deletes both
            try:
                _ip("link", "del", self.host_link)
            except (OSError, subprocess.TimeoutExpired):
                pass  # already gone with its namespace
        if "netns" in self._created:
            try:
                _ip("netns", "del", self.namespace)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._created.clear()
