"""Engine prefix caching and prefix-aware routing, live: 2 embedded workers, 8 tenants with long system prompts.

    python bench/prefix_cache.py [--requests 64] [--clients 4]

Each of 8 tenants has its own ~1,000-token system prompt; every request is that prompt plus a short,
distinct user turn (16 tokens out, streamed). The same closed-loop load runs against `tidegate
serve` with two `tiny-random-llama` workers (one thread each) in three set-ups, each started fresh:
- off: engines without prefix caching (`--no-prefix-caching`), least-loaded routing (fewest requests
  outstanding: `overload_control: false`);
- cache: prefix caching on, least-loaded routing;
- cache + affinity: both on, the defaults (the pool controller with prefix-aware routing);
- and, for reference, cache + the controller without affinity (`limits.prefix_cache_tokens: 0`).
`--kv-cache-tokens N` sizes each worker's KV cache (default: the engine's, 32,768 tokens, which holds
every tenant's prompt on every worker; 8,192 holds about five beside the running sequences: the
regime of a GPU whose cache cannot keep every tenant's prefix, where routing decides what stays).
Prints per set-up P50/P99 TTFT, requests per worker (from each worker's own /metrics), the
workers' prefix-cache hit rate and busy fraction, and the bars: P50 TTFT with both on <= 0.3x
both off and <= 0.6x cache alone; load imbalance between workers <= 1.5x.
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

WORDS = ("policy shipping refund warranty account invoice delivery order parcel courier address payment card "
         "return exchange size colour stock store opening hours contact email phone support ticket priority "
         "premium member discount coupon voucher gift wrap express standard tracking number label customs").split()
# engine flags, limits.prefix_cache_tokens (None: overload control off, least-loaded routing)
SETUPS: dict[str, tuple[list[str], int | None]] = {
    "off": (["--no-prefix-caching"], None),
    "cache": ([], None),
    "cache + affinity": ([], 32768),
    "cache, no affinity": ([], 0),
}


def system_prompt(tenant: int, words: int = 130) -> str:  # ~1,000 tokens of tiny-random-llama
    rng = random.Random(tenant)
    return f"You are the assistant of shop number {tenant}. Rules: " + " ".join(rng.choice(WORDS) for _ in range(words))


def start_gateway(workdir: Path, engine_args: list[str], prefix_cache_tokens: int | None,
                  kv_cache_tokens: int | None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    config = workdir / f"gateway-{port}.yaml"
    if kv_cache_tokens is not None:
        engine_args = [*engine_args, "--kv-cache-tokens", str(kv_cache_tokens)]
    args = "[" + ", ".join(f"'{a}'" for a in engine_args) + "]"
    routing = "overload_control: false\n" if prefix_cache_tokens is None else \
        f"limits: {{prefix_cache_tokens: {prefix_cache_tokens}}}\n"
    config.write_text(
        f"server: {{port: {port}, access_log: false}}\n"
        f"{routing}"
        "pools:\n  - name: m\n    backends:\n"
        f"      - {{type: embedded, model: tiny-random-llama, count: 2, threads: 1, engine_args: {args}}}\n")
    process = subprocess.Popen([sys.executable, "-m", "tidegate", "serve", "--config", str(config)],
                               stdout=subprocess.DEVNULL, stderr=open(workdir / f"gateway-{port}.log", "w"))
    wait_ok(f"http://127.0.0.1:{port}/ready", 300)
    return process, port


async def worker_ports(session: aiohttp.ClientSession, port: int) -> list[int]:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
        text = await response.text()
    return sorted({int(p) for p in re.findall(r'tidegate_replica_outstanding\{pool="m",replica="m#\d+@127\.0\.0\.1:(\d+)"',
                                              text)})


async def worker_counts(session: aiohttp.ClientSession, ports: list[int]) -> list[dict[str, float]]:
    names = {"requests": "tidegate_engine_e2e_seconds_count", "busy": "tidegate_engine_busy_seconds_total",
             "queried": "tidegate_engine_prefix_cache_queries_tokens_total",
             "hits": "tidegate_engine_prefix_cache_hits_tokens_total"}
    counts = []
    for worker in ports:
        async with session.get(f"http://127.0.0.1:{worker}/metrics") as response:
            text = await response.text()
        values = {}
        for key, name in names.items():
            found = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
            values[key] = float(found.group(1)) if found else 0.0
        counts.append(values)
    return counts


async def load(port: int, requests: int, clients: int) -> list[float]:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    prompts = [system_prompt(tenant) for tenant in range(8)]
    # tenants in a random (seeded) order, as independent users arrive: a fixed rotation would let
    # least-loaded routing split the tenants between two workers by accident
    order = random.Random(requests).choices(range(8), k=requests)
    work = iter(range(requests))
    ttfts: list[float] = []
    deadline = time.monotonic() + 600

    async def client(session: aiohttp.ClientSession) -> None:
        for index in work:
            if time.monotonic() > deadline:
                return
            tenant = order[index]
            body = {"model": "m", "max_tokens": 16, "stream": True, "temperature": 0, "ignore_eos": True,
                    "messages": [{"role": "system", "content": prompts[tenant]},
                                 {"role": "user", "content": f"Question {index}: where is order {index * 7919}?"}]}
            started = time.perf_counter()
            first = None
            async with session.post(url, json=body) as response:
                assert response.status == 200, await response.text()
                async for line in response.content:
                    if first is None and b'"content"' in line:
                        first = time.perf_counter() - started
            ttfts.append(first if first is not None else time.perf_counter() - started)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return ttfts


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_setup(workdir: Path, name: str, requests: int, clients: int, kv_cache_tokens: int | None
                    ) -> dict[str, float]:
    engine_args, prefix_tokens = SETUPS[name]
    process, port = start_gateway(workdir, engine_args, prefix_tokens, kv_cache_tokens)
    try:
        async with aiohttp.ClientSession() as session:
            ports = await worker_ports(session, port)
        await load(port, 16, 2)  # warm-up (each engine's first steps are slow)
        async with aiohttp.ClientSession() as session:
            before = await worker_counts(session, ports)
        started = time.monotonic()
        ttfts = await load(port, requests, clients)
        seconds = time.monotonic() - started
        async with aiohttp.ClientSession() as session:
            after = await worker_counts(session, ports)
    finally:
        process.terminate()
        process.wait(timeout=60)
    served = [a["requests"] - b["requests"] for a, b in zip(after, before)]
    busy = [(a["busy"] - b["busy"]) / seconds for a, b in zip(after, before)]
    queried = sum(a["queried"] - b["queried"] for a, b in zip(after, before))
    hits = sum(a["hits"] - b["hits"] for a, b in zip(after, before))
    imbalance = max(served) / max(1.0, min(served))
    result = {"p50": percentile(ttfts, 0.5), "p99": percentile(ttfts, 0.99), "imbalance": imbalance}
    print(f"{name:>17}: TTFT p50 {result['p50'] * 1e3:7.0f} ms  p99 {result['p99'] * 1e3:7.0f} ms | "
          f"{len(ttfts)} served in {seconds:5.1f} s | per worker {[int(s) for s in served]} "
          f"(imbalance {imbalance:.2f}x) | busy {[f'{b:.0%}' for b in busy]} | "
          f"prefix hits {hits / queried if queried else 0:.0%} of {int(queried)} prompt tokens")
    return result


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--kv-cache-tokens", type=int, default=None)
    args = parser.parse_args()
    print(f"KV cache per worker: {args.kv_cache_tokens or 'the engine default'} tokens")
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: await run_setup(Path(tmp), name, args.requests, args.clients, args.kv_cache_tokens)
                   for name in SETUPS}
    both, off, cache = results["cache + affinity"]["p50"], results["off"]["p50"], results["cache"]["p50"]
    verdict = lambda ok: "PASS" if ok else "FAIL"  # noqa: E731
    print(f"P50 TTFT, both on / both off = {both / off:.2f}x (bar <= 0.3x: {verdict(both <= 0.3 * off)})")
    print(f"P50 TTFT, both on / cache alone = {both / cache:.2f}x (bar <= 0.6x: {verdict(both <= 0.6 * cache)})")
    imbalance = results["cache + affinity"]["imbalance"]
    print(f"load imbalance between workers, both on: {imbalance:.2f}x (bar <= 1.5x: {verdict(imbalance <= 1.5)})")


if __name__ == "__main__":
    asyncio.run(main())
