"""The exact response cache and single-flight coalescing, measured through a live gateway.

    python bench/response_cache.py [--requests 2000] [--clients 8] [--repeats 0.30]

Starts `tidegate mock-upstream` (20 ms to the first token, 16 tokens) and `tidegate serve` with
`response_cache` on its pool, then:
1. a Zipf-distributed mix of deterministic chat requests (temperature 0) whose share of repeats is
   `--repeats` (the universe of distinct prompts is sized for it, seeded), sent by `--clients`
   closed-loop clients: prints requests, repeats, upstream requests (the mock's own counter) and
   the fall in upstream requests. Bar: the fall is >= 28 % at 30 % repeats;
2. a hit's added latency: one client, sequential, a cached request against the gateway's
   `/health` (the same client, connection and HTTP round trip, no cache work); prints p50/p99 of
   both and the difference. Bar: added p99 <= 1 ms;
3. 100 identical concurrent requests (a 1 s upstream): upstream requests made and answers that
   equal the first. Bar: exactly 1 upstream request and 100 equal answers.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from gateway_overhead import free_port, wait_ok  # bench/ is the script's directory


def start(argv: list[str], ready_url: str, log: Path) -> subprocess.Popen:
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    wait_ok(ready_url, 60)
    return process


def start_mock(workdir: Path, ttft_ms: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    argv = [sys.executable, "-m", "tidegate", "mock-upstream", "--port", str(port), "--tokens", "16",
            "--ttft-ms", str(ttft_ms), "--itl-ms", "1"]
    return start(argv, f"http://127.0.0.1:{port}/health", workdir / f"mock-{port}.log"), port


def start_gateway(workdir: Path, mock_port: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    config = workdir / f"gateway-{port}.yaml"
    config.write_text(
        f"server: {{port: {port}, access_log: false}}\n"
        "pools:\n  - name: m\n    response_cache: {}\n    backends:\n"
        f"      - {{type: upstream, url: 'http://127.0.0.1:{mock_port}/v1', slot_limit: 256}}\n")
    argv = [sys.executable, "-m", "tidegate", "serve", "--config", str(config)]
    return start(argv, f"http://127.0.0.1:{port}/ready", workdir / f"gateway-{port}.log"), port


async def upstream_requests(session: aiohttp.ClientSession, mock_port: int) -> int:
    async with session.get(f"http://127.0.0.1:{mock_port}/metrics") as response:
        text = await response.text()
    return int(re.search(r"^mock_api_requests_total (\d+)", text, re.M).group(1))


def zipf_mix(requests: int, repeats: float, seed: int, exponent: float = 0.8) -> list[int]:
    """Prompt indices drawn from Zipf(exponent) over a universe sized so that `repeats` of the
    requests ask a prompt asked before (found by bisection on the universe size, same seed). An
    exponent below 1: above it the head alone repeats more than half the requests at any size."""
    def draw(universe: int) -> list[int]:
        rng = random.Random(seed)
        weights = [1 / (rank + 1) ** exponent for rank in range(universe)]
        return rng.choices(range(universe), weights=weights, k=requests)

    low, high = 1, requests * 200
    while high - low > 1:
        middle = (low + high) // 2
        mix = draw(middle)
        if 1 - len(set(mix)) / requests > repeats:
            low = middle
        else:
            high = middle
    return draw(high)


def body(prompt: int, stream: bool = False) -> dict:
    return {"model": "m", "temperature": 0, "max_tokens": 16, "stream": stream,
            "messages": [{"role": "user", "content": f"question number {prompt}: what does it cost?"}]}


async def mix_run(port: int, mock_port: int, requests: int, clients: int, repeats: float) -> None:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    mix = zipf_mix(requests, repeats, seed=7)
    actual_repeats = 1 - len(set(mix)) / len(mix)
    statuses: dict[int, int] = {}
    outcomes: dict[str, int] = {}
    queue = iter(mix)
    deadline = time.monotonic() + 300

    async def client(session: aiohttp.ClientSession) -> None:
        for prompt in queue:
            if time.monotonic() > deadline:
                return
            # a prompt is asked the same way each time (an app streams or it does not): a stream
            # and a whole answer are cached apart, as they are different answers
            async with session.post(url, json=body(prompt, stream=prompt % 2 == 1)) as response:
                await response.read()
                statuses[response.status] = statuses.get(response.status, 0) + 1
                state = response.headers.get("x-tidegate-cache", "none")
                outcomes[state] = outcomes.get(state, 0) + 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        before = await upstream_requests(session, mock_port)
        started = time.monotonic()
        await asyncio.gather(*(client(session) for _ in range(clients)))
        seconds = time.monotonic() - started
        upstream = await upstream_requests(session, mock_port) - before
    sent = sum(statuses.values())
    fall = 1 - upstream / sent
    print(f"1. Zipf mix: {sent} requests ({actual_repeats:.1%} repeats, half streamed) in {seconds:.1f} s, "
          f"statuses {statuses}, cache {outcomes}")
    print(f"   upstream requests {upstream} of {sent}: fall {fall:.1%} (bar >= 28%: "
          f"{'PASS' if fall >= 0.28 else 'FAIL'}; the most a cache can save is the repeats, {actual_repeats:.1%})")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def hit_latency(port: int, samples: int) -> None:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    health = f"http://127.0.0.1:{port}/health"
    hits: list[float] = []
    probes: list[float] = []
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.post(url, json=body(10**6)) as response:  # stored
            await response.read()
        for _ in range(samples):  # alternated, so that noise hits both alike
            started = time.perf_counter()
            async with session.post(url, json=body(10**6)) as response:
                await response.read()
                assert response.headers["x-tidegate-cache"] == "hit"
            hits.append(time.perf_counter() - started)
            started = time.perf_counter()
            async with session.get(health) as response:
                await response.read()
            probes.append(time.perf_counter() - started)
    hit_p50, hit_p99 = percentile(hits, 0.5) * 1e3, percentile(hits, 0.99) * 1e3
    probe_p50, probe_p99 = percentile(probes, 0.5) * 1e3, percentile(probes, 0.99) * 1e3
    added = hit_p99 - probe_p99
    print(f"2. cache hit, {samples} sequential: p50 {hit_p50:.3f} ms, p99 {hit_p99:.3f} ms; /health on the same "
          f"connection p50 {probe_p50:.3f} ms, p99 {probe_p99:.3f} ms")
    print(f"   added by a hit: p50 {hit_p50 - probe_p50:.3f} ms, p99 {added:.3f} ms "
          f"(bar <= 1 ms: {'PASS' if added <= 1.0 else 'FAIL'})")


async def stampede(port: int, mock_port: int, count: int) -> None:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    connector = aiohttp.TCPConnector(limit=count)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        before = await upstream_requests(session, mock_port)

        async def one() -> tuple[int, str]:
            async with session.post(url, json=body(-1, stream=True)) as response:
                return response.status, await response.text()

        answers = await asyncio.gather(*(one() for _ in range(count)))
        upstream = await upstream_requests(session, mock_port) - before
    first = answers[0][1]
    equal = sum(1 for status, text in answers if status == 200 and text == first and "[DONE]" in text)
    verdict = "PASS" if upstream == 1 and equal == count else "FAIL"
    print(f"3. {count} identical concurrent streams: {upstream} upstream request(s), {equal} equal complete answers "
          f"(bar 1 and {count}: {verdict})")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--repeats", type=float, default=0.30)
    parser.add_argument("--hit-samples", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        mock, mock_port = start_mock(workdir, ttft_ms=20)
        slow, slow_port = start_mock(workdir, ttft_ms=1000)
        gateway, port = start_gateway(workdir, mock_port)
        slow_gateway, slow_gateway_port = start_gateway(workdir, slow_port)
        try:
            await mix_run(port, mock_port, args.requests, args.clients, args.repeats)
            await hit_latency(port, args.hit_samples)
            await stampede(slow_gateway_port, slow_port, 100)
        finally:
            for process in (gateway, slow_gateway, mock, slow):
                process.terminate()
                process.wait(timeout=20)


if __name__ == "__main__":
    asyncio.run(main())
