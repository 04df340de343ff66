"""Instructions a request through one live gateway, overload control on and off, and where they go.

    python bench/gateway_instructions.py [--requests 3000] [--warmup 1000] [--concurrency 64]
    python bench/gateway_instructions.py --annotate 40     # + the top C functions, inclusive
    python bench/gateway_instructions.py --profile         # Python functions: calls a request (cProfile)
    python bench/gateway_instructions.py --tracing         # overload control on, tracing off and on

CPU time per request on a shared machine moves by a third between rounds; instructions do not. Each
gateway (`tidegate serve` over a 0 ms mock upstream, non-streaming, no tenants, access log off, as in
bench/gateway_overhead.py) runs under `valgrind --tool=callgrind`; after `--warmup` requests its
counters are zeroed, `--requests` more are sent from `--concurrency` keep-alive connections, and its
counters are dumped once all have been answered: the instructions counted, divided by the requests,
are the gateway's per request (user space, its background timers included, which are few).

--annotate N: the N C functions with the most inclusive instructions in the measured window
(callgrind_annotate); Python code shows only as the interpreter's frames, so this finds allocations,
the event loop's handles and futures, and C extensions (httptools, orjson, uvloop).

--profile: no valgrind. Each gateway runs under cProfile, switched on for the measured requests only
(SIGUSR1 / SIGUSR2), and prints the Python functions by calls a request and by own time. Times under
a profiler are inflated and only their order means much; the call counts are exact.

--tracing: two gateways with overload control on, tracing off and on (sampling 1.0, the built-in
exporter sending every span to a loopback sink, bench/otlp_sink.py), as bench/gateway_overhead.py
--tracing runs them. Each waits `--settle-s` after the warm-up and after the measured requests, so
that the window holds the export task's encoding of the measured requests' spans and not of the
warm-up's; the gateway without tracing waits alike.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httptools

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gateway_overhead import TOKENS, free_port, request_body, wait_ok  # noqa: E402

# a gateway under valgrind runs some 50x slower: its health checks must not time out meanwhile
HEALTH_TIMEOUT_S = 60.0

# Runs `tidegate serve` with a profiler that SIGUSR1 switches on and SIGUSR2 switches off and saves
_PROFILED_SERVE = """
import cProfile, signal, sys
from tidegate.cli import main
profiler = cProfile.Profile()
def start(*_): profiler.enable()
def stop(*_):
    profiler.disable()
    profiler.dump_stats(sys.argv[1])
signal.signal(signal.SIGUSR1, start)
signal.signal(signal.SIGUSR2, stop)
sys.exit(main(sys.argv[2:]))
"""


class _Client(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[int] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        assert self.done is not None
        self.done.set_result(self.parser.get_status_code())


async def _send(port: int, body: bytes, concurrency: int, requests: int) -> dict[int, int]:
    """Sends exactly `requests` requests over `concurrency` connections; returns answers by status."""
    loop = asyncio.get_running_loop()
    raw = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
           f"content-length: {len(body)}\r\n\r\n").encode() + body
    left = [requests]
    statuses: dict[int, int] = {}

    async def worker() -> None:
        _, client = await loop.create_connection(_Client, "127.0.0.1", port)
        while left[0] > 0:
            left[0] -= 1
            client.done = loop.create_future()
            client.transport.write(raw)
            status = await client.done
            statuses[status] = statuses.get(status, 0) + 1
        client.transport.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return statuses


def send(port: int, body: bytes, concurrency: int, requests: int) -> None:
    statuses = asyncio.run(_send(port, body, concurrency, requests))
    if set(statuses) != {200}:  # a refused request costs less: the count would mean nothing
        raise RuntimeError(f"answers by status: {statuses} (of {requests} requests)")


def _config(workdir: str, name: str, port: int, mock_port: int, overload: bool, sink_port: int | None = None
            ) -> str:
    path = Path(workdir, f"{name}.yaml")
    tracing = "" if sink_port is None else (f"tracing:\n  enabled: true\n  sampling_ratio: 1.0\n"
                                            f"  endpoint: http://127.0.0.1:{sink_port}\n")
    path.write_text(f"overload_control: {'true' if overload else 'false'}\nserver:\n  port: {port}\n"
                    f"  access_log: false\nhealth:\n  timeout_s: {HEALTH_TIMEOUT_S}\n{tracing}pools:\n  - name: mock\n"
                    f"    backends:\n      - type: upstream\n        url: http://127.0.0.1:{mock_port}/v1\n")
    return str(path)


def _wait_ready(gateway: subprocess.Popen, port: int, timeout_s: float = 600.0) -> None:
    """Until the gateway answers /ready (minutes under valgrind); raises at once if it exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if gateway.poll() is not None:
            raise RuntimeError(f"the gateway exited ({gateway.returncode}) before it was ready")
        try:
            wait_ok(f"http://127.0.0.1:{port}/ready", timeout_s=1.0)
            return
        except TimeoutError:
            continue
    raise TimeoutError(f"the gateway on port {port} was not ready in {timeout_s:.0f} s")


def _callgrind_total(dump: Path) -> int:
    """Instructions of one callgrind dump (its `summary:` or `totals:` line)."""
    text = dump.read_text(errors="replace")
    found = re.search(r"^(?:summary|totals):\s+(\d+)", text, re.M)
    if found is None:
        raise RuntimeError(f"no totals in {dump}")
    return int(found.group(1))


def measure(name: str, overload: bool, args: argparse.Namespace, workdir: str, mock_port: int,
            sink_port: int | None = None) -> None:
    port = free_port()
    config = _config(workdir, name, port, mock_port, overload, sink_port)
    serve = ["serve", "--config", config, "--log-level", "warning"]
    profile_out = os.path.join(workdir, f"{name}.prof")
    if args.profile:
        argv = [sys.executable, "-c", _PROFILED_SERVE, profile_out, *serve]
    else:
        argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={workdir}/{name}.%p.out",
                sys.executable, "-m", "tidegate", *serve]
    log = open(os.path.join(workdir, f"{name}.log"), "wb")
    gateway = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    body = request_body(False, "mock")
    try:
        _wait_ready(gateway, port)
        send(port, body, args.concurrency, args.warmup)
        time.sleep(args.settle_s)
        if args.profile:
            gateway.send_signal(signal.SIGUSR1)
            time.sleep(0.2)
        else:
            subprocess.run(["callgrind_control", "--zero", str(gateway.pid)], check=True, capture_output=True)
        send(port, body, args.concurrency, args.requests)
        time.sleep(args.settle_s)
        if args.profile:
            gateway.send_signal(signal.SIGUSR2)
            for _ in range(100):
                if os.path.exists(profile_out):
                    break
                time.sleep(0.1)
            time.sleep(0.5)
            _print_profile(name, profile_out, args.requests, args.top)
            return
        subprocess.run(["callgrind_control", "--dump", str(gateway.pid)], check=True, capture_output=True)
        dumps = sorted(Path(workdir).glob(f"{name}.{gateway.pid}.out.*"))
        total = _callgrind_total(dumps[-1])
        print(f"{name}: {total / args.requests:,.0f} instructions a request "
              f"({total:,} / {args.requests:,}, after {args.warmup:,} warm-up requests, c={args.concurrency})")
        if args.annotate:
            annotated = subprocess.run(["callgrind_annotate", "--inclusive=yes", f"--threshold=100",
                                        str(dumps[-1])], capture_output=True, text=True, check=True).stdout
            rows = [line for line in annotated.splitlines() if re.match(r"^\s*[\d,]+ \(", line)]
            for line in rows[:args.annotate]:
                count = int(line.split()[0].replace(",", ""))
                print(f"  {count / args.requests:>9,.0f}  {line.split(None, 2)[2][:140]}")
    finally:
        gateway.send_signal(signal.SIGTERM)
        try:
            gateway.wait(timeout=60)
        except subprocess.TimeoutExpired:
            gateway.kill()
        log.close()


def _print_profile(name: str, path: str, requests: int, top: int) -> None:
    stats = pstats.Stats(path)
    rows = []
    functions = stats.stats.items()  # type: ignore[attr-defined]
    for (filename, line, function), (_, calls, own_s, cumulative_s, _) in functions:
        where = filename.split("/src/")[-1] if "/src/" in filename else os.path.basename(filename)
        rows.append((calls / requests, own_s / requests * 1e6, cumulative_s / requests * 1e6,
                     f"{where}:{line} {function}"))
    total_us = sum(row[1] for row in rows)
    print(f"\n{name}: {len(rows)} functions, {total_us:.1f} us a request of own time under the profiler")
    print("  by calls a request:            calls    own us   cum us")
    for calls, own, cumulative, label in sorted(rows, reverse=True)[:top]:
        print(f"  {label[:60]:<60} {calls:7.2f} {own:8.2f} {cumulative:8.2f}")
    print("  by own time:")
    for calls, own, cumulative, label in sorted(rows, key=lambda row: -row[1])[:top]:
        print(f"  {label[:60]:<60} {calls:7.2f} {own:8.2f} {cumulative:8.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--annotate", type=int, default=0, help="print the top N C functions (inclusive)")
    parser.add_argument("--profile", action="store_true", help="cProfile instead of callgrind")
    parser.add_argument("--top", type=int, default=40, help="--profile: rows printed")
    parser.add_argument("--only", choices=("on", "off"),
                        help="measure only the gateway with overload control (--tracing: tracing) on/off")
    parser.add_argument("--tracing", action="store_true", help="overload control on, tracing off and on")
    parser.add_argument("--settle-s", type=float, default=0.0,
                        help="wait after the warm-up and after the requests (--tracing: 10 unless set)")
    args = parser.parse_args()
    if args.tracing and not args.settle_s:
        args.settle_s = 10.0  # the exporter's 1 s interval, some 50x slower under valgrind
    workdir = tempfile.mkdtemp(prefix="tidegate-instructions-")
    mock_port = free_port()
    mock = subprocess.Popen([sys.executable, "-m", "tidegate", "mock-upstream", "--port", str(mock_port), "--tokens",
                             str(TOKENS), "--ttft-ms", "0", "--itl-ms", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    sink = sink_port = None
    try:
        wait_ok(f"http://127.0.0.1:{mock_port}/health")
        if args.tracing:
            sink_port = free_port()
            sink = subprocess.Popen([sys.executable, str(HERE / "otlp_sink.py"), "--port", str(sink_port)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            wait_ok(f"http://127.0.0.1:{sink_port}/stats")
            for name, traced in (("tracing off", None), ("tracing on", sink_port)):
                if args.only is None or args.only == name.split()[-1]:
                    measure(name.replace(" ", "-"), True, args, workdir, mock_port, traced)
            return 0
        for name, overload in (("overload on", True), ("overload off", False)):
            if args.only is None or args.only == name.split()[-1]:
                measure(name.replace(" ", "-"), overload, args, workdir, mock_port)
    finally:
        for process in (sink, mock):
            if process is not None:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
