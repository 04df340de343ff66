"""Per-tenant limits shared by 3 gateway processes through one Redis, against the in-process buckets.

    python bench/shared_limits.py [--seconds 60] [--rpm 6000] [--pin]

One tenant offers 3x its RPM and TPM limits for `--seconds`, open loop, spread round-robin over 3
`tidegate serve` processes in front of one 0 ms mock upstream (`tidegate mock-upstream`), twice:
- `shared_state: memory`, each gateway holding a third of the limits (what one configures without
  shared state; exact only while the load balancer splits the traffic evenly, as here);
- `shared_state: redis`, the whole limits, on a `redis-server` the bench starts.
Each request reserves prompt + max_tokens (55 + 100) and uses 55 + 45 tokens, so the requests and
the tokens limits bind together. Prints, per phase, the requests and tokens admitted (per process
and in all) against burst + rate x time (bar: within +-2 % with Redis), the gateways' CPU time per
request handled (admitted or refused; bar: Redis <= 1.3x memory), Redis's own CPU per request, and
the latency of admitted and refused requests.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import httptools
import orjson

from gateway_overhead import free_port, wait_ok  # bench/ is the script's directory

GATEWAYS = 3
PROMPT = "The tide gate opens when the sea falls below the river, and closes when it rises. " * 3
COMPLETION_TOKENS = 45  # the mock's answer; max_tokens reserves more
MAX_TOKENS = 100
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prompt_tokens() -> int:
    """What the gateway reserves for the prompt (its own estimate, which settlement charges too)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from tidegate.gateway.overload import estimate_prompt_tokens

    return estimate_prompt_tokens({"messages": [{"role": "user", "content": PROMPT}]})


# -- the open-loop client ------------------------------------------------------------------------

class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[tuple[int, bytes]] | None = None
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("closed"))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result((self.parser.get_status_code(), b"".join(self.body)))


class Result:
    __slots__ = ("gateway", "sent_s", "latency_s", "status", "completion_tokens")

    def __init__(self, gateway: int, sent_s: float, latency_s: float, status: int, completion_tokens: int) -> None:
        self.gateway, self.sent_s, self.latency_s = gateway, sent_s, latency_s
        self.status, self.completion_tokens = status, completion_tokens


async def offer(ports: list[int], rate_per_s: float, seconds: float, key: str) -> tuple[list[Result], float]:
    """`rate_per_s` requests a second for `seconds`, on schedule (open loop), dealt round-robin."""
    loop = asyncio.get_running_loop()
    body = orjson.dumps({"model": "m", "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": PROMPT}]})
    raw = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {key}\r\n"
           f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body
    idle: list[list[_Connection]] = [[] for _ in ports]
    results: list[Result] = []
    pending: set[asyncio.Task] = set()

    async def one(index: int, start: float) -> None:
        pool = idle[index]
        conn = pool.pop() if pool else (await loop.create_connection(_Connection, "127.0.0.1", ports[index]))[1]
        conn.done, conn.body = loop.create_future(), []
        sent = time.perf_counter()
        conn.transport.write(raw)
        status, answer = await conn.done
        latency = time.perf_counter() - sent
        found = _COMPLETION.search(answer) if status == 200 else None
        results.append(Result(index, sent - start, latency, status, int(found.group(1)) if found else 0))
        pool.append(conn)

    start = time.perf_counter()
    issued = 0
    while True:
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            break
        due = min(int(elapsed * rate_per_s) + 1, int(seconds * rate_per_s)) - issued
        for _ in range(due):
            task = loop.create_task(one(issued % len(ports), start))
            pending.add(task)
            task.add_done_callback(pending.discard)
            issued += 1
        await asyncio.sleep(0.002)
    if pending:
        await asyncio.gather(*pending)
    for pool in idle:
        for conn in pool:
            conn.transport.close()
    return results, time.perf_counter() - start


def run_offer(ports: list[int], rate_per_s: float, seconds: float, key: str) -> tuple[list[Result], float]:
    try:
        import uvloop

        return uvloop.run(offer(ports, rate_per_s, seconds, key))
    except ImportError:
        return asyncio.run(offer(ports, rate_per_s, seconds, key))


# -- processes -----------------------------------------------------------------------------------

class Stack:
    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.workdir = tempfile.mkdtemp(prefix="tidegate-shared-limits-")
        self.processes: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str], cpu: str) -> subprocess.Popen:
        if self.pin:
            argv = ["taskset", "-c", cpu, *argv]  # taskset execs: the same pid
        log = open(os.path.join(self.workdir, f"{name}.log"), "wb")
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self.processes[name] = process
        return process

    def stop(self, *names: str) -> None:
        for name in names or list(self.processes):
            process = self.processes.pop(name)
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def log(self, name: str) -> str:
        return Path(self.workdir, f"{name}.log").read_text(errors="replace")


def gateway_config(port: int, mock_port: int, rpm: int, tpm: int, shared_state: dict) -> str:
    import yaml

    return yaml.safe_dump({
        "server": {"port": port, "access_log": False},
        "pools": [{"name": "m", "backends": [{"type": "upstream", "url": f"http://127.0.0.1:{mock_port}/v1",
                                              "slot_limit": 256}]}],
        "tenants": {"bench": {"api_keys": ["sk-bench"], "requests_per_minute": rpm, "tokens_per_minute": tpm},
                    "warm": {"api_keys": ["sk-warm"]}},
        "shared_state": shared_state,
    })


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each phase")
    parser.add_argument("--rpm", type=int, default=6000, help="the tenant's requests per minute (a multiple of 3)")
    parser.add_argument("--pin", action="store_true", help="gateways on CPU 1; client, mock and Redis on CPU 0")
    args = parser.parse_args()
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        print("redis-server is not installed")
        return 2
    rpm = args.rpm - args.rpm % GATEWAYS
    prompt = prompt_tokens()
    used = prompt + COMPLETION_TOKENS
    tpm = rpm * used  # both limits bind at the same rate
    rate_per_s = 3 * rpm / 60.0
    if args.pin:
        os.sched_setaffinity(0, {0})
    py = sys.executable
    stack = Stack(args.pin)
    mock_port, redis_port = free_port(), free_port()
    stack.start("mock", [py, "-m", "tidegate", "mock-upstream", "--port", str(mock_port), "--tokens",
                         str(COMPLETION_TOKENS), "--ttft-ms", "0", "--itl-ms", "0"], "0")
    redis_proc = stack.start("redis", [redis_server, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no"], "0")
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    wait_ok(f"http://127.0.0.1:{mock_port}/health")
    print(f"{GATEWAYS} gateways, one tenant at 3x its limits: {rpm:,} requests and {tpm:,} tokens a minute "
          f"(each request reserves {prompt}+{MAX_TOKENS}, uses {prompt}+{COMPLETION_TOKENS}); offered "
          f"{rate_per_s:.0f} requests/s for {args.seconds:.0f} s per phase; cores: {os.cpu_count()}, "
          f"pinned: {args.pin}")
    ok = True
    cpu_per_request: dict[str, float] = {}
    try:
        for backend in ("memory", "redis"):
            if backend == "redis":
                subprocess.run(["redis-cli", "-p", str(redis_port), "FLUSHALL"], capture_output=True, check=False)
                shared_state = {"backend": "redis", "redis_url": redis_url}
                limits = (rpm, tpm)
            else:
                shared_state = {"backend": "memory"}
                limits = (rpm // GATEWAYS, tpm // GATEWAYS)
            ports = [free_port() for _ in range(GATEWAYS)]
            names = [f"{backend}-{i}" for i in range(GATEWAYS)]
            for name, port in zip(names, ports):
                path = Path(stack.workdir, f"{name}.yaml")
                path.write_text(gateway_config(port, mock_port, *limits, shared_state))
                stack.start(name, [py, "-m", "tidegate", "serve", "--config", str(path), "--log-level", "warning"],
                            "1")
            for port in ports:
                wait_ok(f"http://127.0.0.1:{port}/ready")
            run_offer(ports, 200, 1.0, "sk-warm")  # connections and code paths warm, outside the tenant's limits
            pids = [stack.processes[name].pid for name in names]
            cpu_before = [cpu_seconds(pid) for pid in pids]
            redis_before = cpu_seconds(redis_proc.pid)
            results, elapsed = run_offer(ports, rate_per_s, args.seconds, "sk-bench")
            cpu_used = [cpu_seconds(pid) - before for pid, before in zip(pids, cpu_before)]
            redis_used = cpu_seconds(redis_proc.pid) - redis_before
            stack.stop(*names)

            admitted = [r for r in results if r.status == 200]
            refused = [r for r in results if r.status == 429]
            other = len(results) - len(admitted) - len(refused)
            window_s = max(r.sent_s for r in results) - min(r.sent_s for r in results)
            expected_requests = rpm + rpm / 60.0 * window_s
            expected_tokens = tpm + tpm / 60.0 * window_s
            tokens = sum(prompt + r.completion_tokens for r in admitted)
            split = [sum(1 for r in admitted if r.gateway == i) for i in range(GATEWAYS)]
            requests_error = len(admitted) / expected_requests - 1
            tokens_error = tokens / expected_tokens - 1
            cpu_us = sum(cpu_used) / len(results) * 1e6
            cpu_per_request[backend] = cpu_us
            print(f"\n{backend}: {len(results):,} requests offered in {elapsed:.1f} s ({other} neither 200 nor 429)")
            print(f"  admitted per gateway: {' / '.join(f'{n:,}' for n in split)}")
            within = abs(requests_error) <= 0.02 and abs(tokens_error) <= 0.02
            verdict = f"(bar +-2 %) {'PASS' if within else 'FAIL'}" if backend == "redis" else \
                "(each gateway holds a third: exact only while the traffic splits evenly)"
            if backend == "redis":
                ok &= within and other == 0
            print(f"  requests admitted {len(admitted):,} vs burst + rate x time {expected_requests:,.0f} "
                  f"({requests_error * 100:+.2f} %); tokens {tokens:,} vs {expected_tokens:,.0f} "
                  f"({tokens_error * 100:+.2f} %) over {window_s:.1f} s {verdict}")
            print(f"  gateway CPU per request: {cpu_us:.0f} us ({' / '.join(f'{c:.2f}' for c in cpu_used)} s); "
                  f"redis-server {redis_used / len(results) * 1e6:.0f} us per request")
            print(f"  latency p50 / p99: admitted {percentile([r.latency_s for r in admitted], 0.5) * 1000:.2f} / "
                  f"{percentile([r.latency_s for r in admitted], 0.99) * 1000:.2f} ms, refused "
                  f"{percentile([r.latency_s for r in refused], 0.5) * 1000:.2f} / "
                  f"{percentile([r.latency_s for r in refused], 0.99) * 1000:.2f} ms")
        ratio = cpu_per_request["redis"] / cpu_per_request["memory"]
        ok &= ratio <= 1.3
        print(f"\ngateway CPU per request, redis / memory: {cpu_per_request['redis']:.0f} / "
              f"{cpu_per_request['memory']:.0f} us = {ratio:.2f}x (bar 1.3x) {'PASS' if ratio <= 1.3 else 'FAIL'}")
    finally:
        stack.stop()
        shutil.rmtree(stack.workdir, ignore_errors=True)
    print(f"\nall bars: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
