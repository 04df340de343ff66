"""Engine prefix caching and prefix-aware routing, live: 2 embedded workers, 8 tenants with long system prompts.

    python bench/prefix_cache.py [--requests 256] [--clients 4]

Each of 8 tenants has its own ~1,000-token system prompt; every request is that prompt plus a short,
distinct user turn (16 tokens out, streamed). The same closed-loop load runs against `tidegate
serve` with two `tiny-random-llama` workers (one thread each) in four set-ups, each started fresh:
- off: engines without prefix caching (`--no-prefix-caching`), least-loaded routing (fewest requests
  outstanding: `overload_control: false`);
- cache: prefix caching on, least-loaded routing;
- cache + affinity: both on, the defaults (the pool controller with prefix-aware routing);
- and, for reference, cache + the controller without affinity (`limits.prefix_cache_tokens: 0`).
Each worker's KV cache is sized to hold about half the tenants' prompts beside its running
sequences (`--kv-cache-tokens`, default 5,120: four ~1,060-token prompts, the model's tokens being
bytes, and the running requests' own blocks). In production a replica's KV cache cannot hold every
tenant's prefix either, and that is what prefix-aware routing is for: it decides which prefixes stay
cached where. With the engine's default, 32,768 tokens, every worker holds all eight prompts, so
least-loaded routing hits as often as affinity and the two differ only in the tail. The gateway
sizes its prefix index for each worker as the worker's /metrics reports its KV cache, in the
characters a token the answers' usage shows (the clients ask streams for it: `include_usage`); this
model's tokens are bytes, a character each.
Prints the KV cache size and, per set-up, P50/P99 TTFT, requests served per worker (from each
worker's own /metrics), the workers' busy fraction and prefix-cache hit rate (hit tokens of looked-up
prompt tokens), how many tenants were served by both workers (from the gateway's access log), and
the bars: P50 TTFT with both on <= 0.3x both off and <= 0.6x cache alone; load imbalance between
workers <= 1.5x, in requests served, with the ratio of their busy fractions printed beside it.
Each set-up is warmed with 16 requests from 2 clients, then measures 256 requests from 4 clients (a
set-up's run stops at 10 minutes; the line says so if one was cut short). 256 because with prefix
affinity each tenant stays where its prompt is cached, so the split is the tenants' volumes over the
run: at 64 requests (3 to 11 a tenant) chance alone puts 8 of the 70 ways to place 4 tenants on each
worker over 1.5x (12 % as a mean over 40 lists drawn the same way), at 128 3 %, at 256 none
(`sim.prefix_bench`, `bench/prefix_placement.py`): a shorter run cannot judge a 1.5x balance. The
whole bench takes about 9 minutes on a 2-core machine it has alone; it prints its time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import aiohttp

from gateway_overhead import free_port, wait_ok  # bench/ is the script's directory
from tidegate.sim.prefix_bench import RUN_CLIENTS, RUN_REQUESTS, WARM_CLIENTS, WARM_REQUESTS

WORDS = ("policy shipping refund warranty account invoice delivery order parcel courier address payment card "
         "return exchange size colour stock store opening hours contact email phone support ticket priority "
         "premium member discount coupon voucher gift wrap express standard tracking number label customs").split()
# engine flags, and whether the controller routes by prefix affinity (None: overload control off,
# least-loaded routing)
SETUPS: dict[str, tuple[list[str], bool | None]] = {
    "off": (["--no-prefix-caching"], None),
    "cache": ([], None),
    "cache + affinity": ([], True),
    "cache, no affinity": ([], False),
}
DEFAULT_KV_CACHE_TOKENS = 5120
RUN_LIMIT_S = 600  # a set-up's measured run stops here, so the whole bench is bounded


def system_prompt(tenant: int, words: int = 130) -> str:  # ~1,000 tokens of tiny-random-llama
    rng = random.Random(tenant)
    return f"You are the assistant of shop number {tenant}. Rules: " + " ".join(rng.choice(WORDS) for _ in range(words))


def start_gateway(workdir: Path, engine_args: list[str], affinity: bool | None,
                  kv_cache_tokens: int) -> tuple[subprocess.Popen, int, Path]:
    port = free_port()
    config = workdir / f"gateway-{port}.yaml"
    engine_args = [*engine_args, "--kv-cache-tokens", str(kv_cache_tokens)]
    args = "[" + ", ".join(f"'{a}'" for a in engine_args) + "]"
    # with affinity the prefix index is sized from what the engines report (nothing configured)
    routing = "overload_control: false\n" if affinity is None else \
        "" if affinity else "limits: {prefix_cache_tokens: 0}\n"
    config.write_text(
        f"server: {{port: {port}, access_log: true}}\n"  # which replica served each request
        f"{routing}"
        "pools:\n  - name: m\n    backends:\n"
        f"      - {{type: embedded, model: tiny-random-llama, count: 2, threads: 1, engine_args: {args}}}\n")
    log = workdir / f"gateway-{port}.log"
    process = subprocess.Popen([sys.executable, "-m", "tidegate", "serve", "--config", str(config)],
                               stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    wait_ok(f"http://127.0.0.1:{port}/ready", 300)
    return process, port, log


def tenant_replicas(log: Path, tag: str) -> dict[int, Counter[str]]:
    """Per tenant, how many of its requests (request ids `{tag}-t{tenant}-{index}`) each replica served,
    from the gateway's access log."""
    served: dict[int, Counter[str]] = defaultdict(Counter)
    for line in log.read_text().splitlines():
        if '"type":"access"' not in line:
            continue
        entry = json.loads(line)
        found = re.fullmatch(rf"{tag}-t(\d+)-\d+", entry.get("request_id", ""))
        if found and entry.get("replica"):
            served[int(found.group(1))][entry["replica"]] += 1
    return served


async def worker_ports(session: aiohttp.ClientSession, port: int) -> list[int]:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
        text = await response.text()
    return sorted({int(p) for p in re.findall(r'tidegate_replica_outstanding\{pool="m",replica="m#\d+@127\.0\.0\.1:(\d+)"',
                                              text)})


async def index_sizes(session: aiohttp.ClientSession, port: int) -> list[int]:
    """The characters of prompt prefixes the gateway counts each worker as holding at most (empty:
    overload control off)."""
    async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
        text = await response.text()
    return [int(float(v)) for v in re.findall(r'^tidegate_replica_prefix_index_characters\{[^}]*\} ([0-9.e+]+)$',
                                              text, re.M)]


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


async def load(port: int, requests: int, clients: int, tag: str) -> tuple[list[float], int]:
    """TTFTs of the answered requests, and how many the gateway refused (503: overload control); the
    clients stop at RUN_LIMIT_S. The tenants' list is the one `sim.prefix_bench` replays."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    prompts = [system_prompt(tenant) for tenant in range(8)]
    # tenants in a random (seeded) order, as independent users arrive: a fixed rotation would let
    # least-loaded routing split the tenants between two workers by accident
    order = random.Random(requests).choices(range(8), k=requests)
    work = iter(range(requests))
    ttfts: list[float] = []
    refused = 0
    deadline = time.monotonic() + RUN_LIMIT_S

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal refused
        for index in work:
            if time.monotonic() > deadline:
                return
            tenant = order[index]
            body = {"model": "m", "max_tokens": 16, "stream": True, "stream_options": {"include_usage": True},
                    "temperature": 0, "ignore_eos": True,
                    "messages": [{"role": "system", "content": prompts[tenant]},
                                 {"role": "user", "content": f"Question {index}: where is order {index * 7919}?"}]}
            started = time.perf_counter()
            first = None
            async with session.post(url, json=body, headers={"x-request-id": f"{tag}-t{tenant}-{index}"}) as response:
                if response.status == 503:
                    refused += 1
                    await response.read()
                    continue
                assert response.status == 200, await response.text()
                async for line in response.content:
                    if first is None and b'"content"' in line:
                        first = time.perf_counter() - started
            ttfts.append(first if first is not None else time.perf_counter() - started)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return ttfts, refused


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_setup(workdir: Path, name: str, requests: int, clients: int, kv_cache_tokens: int
                    ) -> dict[str, float]:
    engine_args, affinity = SETUPS[name]
    process, port, log = start_gateway(workdir, engine_args, affinity, kv_cache_tokens)
    try:
        async with aiohttp.ClientSession() as session:
            ports = await worker_ports(session, port)
        await load(port, WARM_REQUESTS, WARM_CLIENTS, "warm")  # each engine's first steps are slow
        async with aiohttp.ClientSession() as session:
            before = await worker_counts(session, ports)
        started = time.monotonic()
        ttfts, refused = await load(port, requests, clients, "run")
        seconds = time.monotonic() - started
        async with aiohttp.ClientSession() as session:
            after = await worker_counts(session, ports)
            index = await index_sizes(session, port)
    finally:
        process.terminate()
        process.wait(timeout=60)
    spread = tenant_replicas(log, "run")
    served = [a["requests"] - b["requests"] for a, b in zip(after, before)]
    busy = [(a["busy"] - b["busy"]) / seconds for a, b in zip(after, before)]
    queried = sum(a["queried"] - b["queried"] for a, b in zip(after, before))
    hits = sum(a["hits"] - b["hits"] for a, b in zip(after, before))
    imbalance = max(served) / max(1.0, min(served))
    # beside requests, the busy time they cost: a slower worker (one sharing its core with the
    # gateway) may rightly serve fewer, and only the busy fractions tell that from an uneven split
    busy_imbalance = max(busy) / max(1e-9, min(busy))
    result = {"p50": percentile(ttfts, 0.5), "p99": percentile(ttfts, 0.99), "imbalance": imbalance,
              "busy_imbalance": busy_imbalance}
    print(f"{name:>17}: TTFT p50 {result['p50'] * 1e3:7.0f} ms  p99 {result['p99'] * 1e3:7.0f} ms | "
          f"{len(ttfts)} served, {refused} refused, in {seconds:5.1f} s"
          + (f" (CUT SHORT at {RUN_LIMIT_S} s: {requests - len(ttfts) - refused} not sent)"
             if len(ttfts) + refused < requests else "") + f" | per worker {[int(s) for s in served]} "
          f"(imbalance {imbalance:.2f}x) | busy {[f'{b:.0%}' for b in busy]} ({busy_imbalance:.2f}x) | "
          f"prefix hits {hits / queried if queried else 0:.0%} of {int(queried)} prompt tokens"
          + (f" | gateway's prefix index per worker: {index} characters" if index else ""))
    # stickiness: a tenant whose requests all went to one worker finds its prompt there
    majority = sum(max(c.values()) for c in spread.values()) / max(1, sum(sum(c.values()) for c in spread.values()))
    homes = {tenant: sorted(c.items(), key=lambda item: -item[1]) for tenant, c in sorted(spread.items())}
    print(f"{'':>17}  tenants served by both workers: {sum(1 for c in spread.values() if len(c) > 1)} of "
          f"{len(spread)}; requests on their tenant's main worker: {majority:.0%}; per tenant, requests per "
          f"worker: {[[n for _, n in sorted(spread[t].items())] for t in homes]}")
    return result


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=RUN_REQUESTS,
                        help="measured per set-up (fewer cannot judge the 1.5x balance: see above)")
    parser.add_argument("--clients", type=int, default=RUN_CLIENTS)
    parser.add_argument("--setups", default=";".join(SETUPS), help="which set-ups, separated by ';'")
    parser.add_argument("--kv-cache-tokens", type=int, default=DEFAULT_KV_CACHE_TOKENS,
                        help="each worker's KV cache (the engine's own default: 32768)")
    args = parser.parse_args()
    print(f"KV cache per worker: {args.kv_cache_tokens} tokens (one tenant's prompt: "
          f"~{len(system_prompt(0)) + 60} tokens)")
    bench_started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: await run_setup(Path(tmp), name, args.requests, args.clients, args.kv_cache_tokens)
                   for name in args.setups.split(";")}
    print(f"{args.requests} requests a set-up, {len(results)} set-ups, in {time.monotonic() - bench_started:.0f} s")
    if not {"off", "cache", "cache + affinity"} <= results.keys():
        return
    both, off, cache = results["cache + affinity"]["p50"], results["off"]["p50"], results["cache"]["p50"]
    verdict = lambda ok: "PASS" if ok else "FAIL"  # noqa: E731
    print(f"P50 TTFT, both on / both off = {both / off:.2f}x (bar <= 0.3x: {verdict(both <= 0.3 * off)})")
    print(f"P50 TTFT, both on / cache alone = {both / cache:.2f}x (bar <= 0.6x: {verdict(both <= 0.6 * cache)})")
    imbalance = results["cache + affinity"]["imbalance"]
    print(f"load imbalance between workers, both on: {imbalance:.2f}x (bar <= 1.5x: {verdict(imbalance <= 1.5)}); "
          f"their busy fractions {results['cache + affinity']['busy_imbalance']:.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
