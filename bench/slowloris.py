"""Slowloris and idle-connection flood against the gateway: normal latency holds, descriptors come back.

    python bench/slowloris.py [--trickling 500] [--idle 2000] [--timeout-s 6]

Starts a 0 ms mock upstream and `tidegate serve` over it with short client timeouts (head and
keep-alive idle = --timeout-s), then:
1. baseline: p50/p99 of non-streaming chat requests from 4 keep-alive clients, 3 s;
2. attack: opens --trickling connections that send a request head one header line every 2 s, and
   --idle connections that send nothing (half of them after one request each), and measures the
   same normal requests for 3 s while all of them are open;
3. waits for the gateway to close every attack connection (none closes on its own), closes what is
   left, and reads the gateway's open descriptors (/proc/PID/fd) and its close counters (/metrics).
Bar: attack p50 and p99 within 2x of baseline; every attack connection closed by the gateway (the
trickling ones with a 408); the gateway's descriptors back to their baseline, +-5. Linux (/proc).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from gateway_overhead import free_port, wait_ok  # bench/ is the script's directory

ROOT = Path(__file__).resolve().parents[1]
LATENCY_CLIENTS = 4
MEASURE_S = 3.0
TRICKLE_EVERY_S = 2.0
CHAT = json.dumps({"model": "m", "max_tokens": 16,
                   "messages": [{"role": "user", "content": "Say something short."}]}).encode()
CHAT_REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%b" % (len(CHAT), CHAT))
HEALTH_REQUEST = b"GET /health HTTP/1.1\r\nhost: bench\r\n\r\n"



def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def closed_by_reason(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    counts = {}
    for line in text.splitlines():
        if line.startswith("tidegate_client_connections_closed_total{"):
            counts[line.split('reason="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return counts


# -- normal traffic ------------------------------------------------------------------------------

async def read_response(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    await reader.readexactly(length)
    return head


async def measure_latency(port: int, duration_s: float) -> list[float]:
    """Latencies of back-to-back chat requests from LATENCY_CLIENTS keep-alive connections."""
    latencies: list[float] = []
    deadline = time.monotonic() + duration_s

    async def client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.monotonic() < deadline:
                started = time.perf_counter()
                writer.write(CHAT_REQUEST)
                head = await asyncio.wait_for(read_response(reader), 10)
                assert head.startswith(b"HTTP/1.1 200"), head
                latencies.append(time.perf_counter() - started)
        finally:
            writer.close()

    await asyncio.gather(*(client() for _ in range(LATENCY_CLIENTS)))
    return latencies


def percentiles(latencies: list[float]) -> tuple[float, float]:
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    return cuts[49] * 1000, cuts[98] * 1000


# -- the attack ----------------------------------------------------------------------------------

class AttackConnection:
    def __init__(self, kind: str) -> None:
        self.kind = kind  # trickling, idle_after_request, idle_fresh
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.answer = b""  # what the gateway sent before it closed
        self.closed_by_server = False

    async def open(self, port: int) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", port)
        if self.kind == "idle_after_request":
            self.writer.write(HEALTH_REQUEST)
            await read_response(self.reader)
        elif self.kind == "trickling":
            self.writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\n")

    async def hold(self, until: float) -> None:
        """Trickles a header line every TRICKLE_EVERY_S (the trickling kind) until the gateway closes."""
        assert self.reader is not None and self.writer is not None
        line = 0
        while time.monotonic() < until:
            try:
                wait_s = max(0.01, min(TRICKLE_EVERY_S, until - time.monotonic()))
                data = await asyncio.wait_for(self.reader.read(4096), wait_s)
            except asyncio.TimeoutError:
                if self.kind == "trickling":
                    line += 1
                    self.writer.write(b"x-trickle-%d: %s\r\n" % (line, b"y" * 20))
                continue
            except ConnectionError:
                data = b""
            if not data:
                self.closed_by_server = True
                return
            self.answer += data

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def open_all(connections: list[AttackConnection], port: int) -> None:
    limit = asyncio.Semaphore(200)

    async def one(conn: AttackConnection) -> None:
        async with limit:
            await conn.open(port)

    await asyncio.gather(*(one(conn) for conn in connections))


async def run(args: argparse.Namespace, gateway_port: int, gateway_pid: int) -> bool:
    await measure_latency(gateway_port, 1.0)  # warm-up: upstream pool, caches
    baseline = await measure_latency(gateway_port, MEASURE_S)
    await asyncio.sleep(0.5)
    fds_before = open_fds(gateway_pid)

    idle_fresh = args.idle // 2
    connections = ([AttackConnection("trickling") for _ in range(args.trickling)]
                   + [AttackConnection("idle_after_request") for _ in range(args.idle - idle_fresh)]
                   + [AttackConnection("idle_fresh") for _ in range(idle_fresh)])
    opening_started = time.monotonic()
    await open_all(connections, gateway_port)
    opened_s = time.monotonic() - opening_started
    # the gateway closes them after timeout_s, to within two sweeps of a second; give it 5 s more
    hold_until = time.monotonic() + args.timeout_s + 5
    holders = [asyncio.ensure_future(conn.hold(hold_until)) for conn in connections]
    fds_peak = open_fds(gateway_pid)
    attack = await measure_latency(gateway_port, MEASURE_S)
    fds_peak = max(fds_peak, open_fds(gateway_pid))
    open_during = sum(not conn.closed_by_server for conn in connections)
    await asyncio.gather(*holders)
    for conn in connections:
        conn.close()
    await asyncio.sleep(1.0)
    fds_after = open_fds(gateway_pid)
    by_reason = closed_by_reason(gateway_port)

    base_p50, base_p99 = percentiles(baseline)
    attack_p50, attack_p99 = percentiles(attack)
    print(f"attack: {args.trickling} trickling heads (a line every {TRICKLE_EVERY_S:.0f} s), {args.idle} idle "
          f"({args.idle - idle_fresh} after one request, {idle_fresh} fresh); opened in {opened_s:.1f} s; "
          f"gateway timeouts {args.timeout_s:g} s")
    print(f"normal requests, {LATENCY_CLIENTS} keep-alive clients, {MEASURE_S:.0f} s each:")
    print(f"  baseline      p50 {base_p50:6.2f} ms  p99 {base_p99:6.2f} ms  ({len(baseline)} requests)")
    print(f"  under attack  p50 {attack_p50:6.2f} ms  p99 {attack_p99:6.2f} ms  ({len(attack)} requests; "
          f"{open_during} of {len(connections)} attack connections still open at its end)")
    p50_ratio, p99_ratio = attack_p50 / base_p50, attack_p99 / base_p99
    print(f"  ratio         p50 {p50_ratio:.2f}x  p99 {p99_ratio:.2f}x")
    closed = {kind: sum(conn.closed_by_server for conn in connections if conn.kind == kind)
              for kind in ("trickling", "idle_after_request", "idle_fresh")}
    totals = {kind: sum(conn.kind == kind for conn in connections) for kind in closed}
    got_408 = sum(conn.answer.startswith(b"HTTP/1.1 408") for conn in connections if conn.kind == "trickling")
    print("closed by the gateway: " + ", ".join(f"{kind} {closed[kind]}/{totals[kind]}" for kind in closed)
          + f"; trickling answered 408: {got_408}/{totals['trickling']}")
    print("gateway's close counters: " + ", ".join(f"{reason} {count:g}" for reason, count in by_reason.items()))
    print(f"gateway's open descriptors: before {fds_before}, peak {fds_peak}, after {fds_after}")

    checks = {
        "normal p50 and p99 within 2x of baseline": p50_ratio <= 2.0 and p99_ratio <= 2.0,
        "every attack connection closed by the gateway": sum(closed.values()) == len(connections),
        "trickling heads answered 408": got_408 == args.trickling,
        "descriptors back to baseline (+-5)": abs(fds_after - fds_before) <= 5,
    }
    for name, ok in checks.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    return all(checks.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trickling", type=int, default=500)
    parser.add_argument("--idle", type=int, default=2000)
    parser.add_argument("--timeout-s", type=float, default=6.0, help="the gateway's head and idle timeouts")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = args.trickling + args.idle + 256
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(needed, hard), hard))  # the gateway inherits it too
    if min(needed, hard) < needed:
        print(f"the open file limit ({hard}) is below the {needed} this run needs")
        return 2

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    processes: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mock_port, gateway_port = free_port(), free_port()
            logs = [open(Path(tmp) / name, "wb") for name in ("mock.log", "gateway.log")]
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "tidegate", "mock-upstream", "--port", str(mock_port), "--tokens", "16"],
                stdout=logs[0], stderr=subprocess.STDOUT, env=env))
            config = Path(tmp) / "gateway.yaml"
            config.write_text(yaml.safe_dump({
                "server": {"port": gateway_port, "access_log": False, "head_timeout_s": args.timeout_s,
                           "keepalive_timeout_s": args.timeout_s, "body_timeout_s": args.timeout_s},
                "pools": [{"name": "m", "backends": [{"type": "upstream",
                                                      "url": f"http://127.0.0.1:{mock_port}/v1"}]}]}))
            wait_ok(f"http://127.0.0.1:{mock_port}/health")
            processes.append(subprocess.Popen([sys.executable, "-m", "tidegate", "serve", "--config", str(config)],
                                              stdout=logs[1], stderr=subprocess.STDOUT, env=env))
            wait_ok(f"http://127.0.0.1:{gateway_port}/ready")
            passed = asyncio.run(asyncio.wait_for(run(args, gateway_port, processes[1].pid), 120))
            print("PASS" if passed else "FAIL")
            print("gateway log lines about connections:")
            for line in (Path(tmp) / "gateway.log").read_text().splitlines():
                if "connections" in line:
                    print("  " + line)
            return 0 if passed else 1
        finally:
            for process in reversed(processes):
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
                    try:
                        process.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        process.kill()
                        process.wait(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
