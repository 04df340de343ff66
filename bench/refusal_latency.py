"""How long refused requests wait for their refusal, in an overload of the embedded default.

    python bench/refusal_latency.py [--overload 5] [--seconds 30] [--src-before DIR]

Starts `tidegate serve` over an embedded pool of two `tiny-random-llama` workers (one thread each)
with three tenants, one per tier (critical 20 %, standard 40 %, sheddable 40 % of requests),
measures the pool's capacity with a closed loop (once, on the first code run), then offers `--overload` x that rate as a Poisson
stream of non-streamed chat requests (64-token prompts, 16 tokens) for `--seconds`. Prints, per
tier: requests, served, refused, the refusals' latency p50/p99, and how many refusals came only
after 1 s or more (a refusal known early should come at once). Each request has its own prompt, as
different users' do; with `--same-prompt` every request of a tier is the same bytes, which the
gateway takes for resends of one request while their Retry-After runs (rule 10 of `policy.pool`:
held to their deadline, not refused at once). With `--src-before DIR`, the same run is made first on
the code under DIR/src (e.g. a checkout of an older commit), for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from gateway_overhead import free_port, wait_ok  # bench/ is the script's directory

TIERS = {"critical": 0.2, "standard": 0.4, "sheddable": 0.4}
PROMPT = "word " * 59



def start_gateway(workdir: Path, src: str | None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    tenants = "\n".join(f"  {tier}-tenant: {{api_keys: [key-{tier}], tier: {tier}}}" for tier in TIERS)
    config = workdir / f"gateway-{port}.yaml"
    config.write_text(
        f"server: {{port: {port}, access_log: false}}\n"
        "pools:\n  - name: m\n    backends:\n"
        "      - {type: embedded, model: tiny-random-llama, count: 2, threads: 1}\n"
        f"tenants:\n{tenants}\n")
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = src
    process = subprocess.Popen([sys.executable, "-m", "tidegate", "serve", "--config", str(config)], env=env,
                               stdout=subprocess.DEVNULL, stderr=open(workdir / f"gateway-{port}.log", "w"))
    wait_ok(f"http://127.0.0.1:{port}/ready", 300)
    return process, port


def body(index: int | None = None) -> dict:
    """A request; `index`: its own prompt (None: the same prompt as every other request)."""
    content = PROMPT + ("word" if index is None else f"q{index}")
    return {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": content}]}


async def capacity(port: int, seconds: float = 10.0, in_flight: int = 32) -> float:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    done = 0
    deadline = time.monotonic() + seconds

    async def loop(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.monotonic() < deadline:
            async with session.post(url, json=body(), headers={"authorization": "Bearer key-standard"}) as response:
                await response.read()
                done += response.status == 200

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        started = time.monotonic()
        await asyncio.gather(*(loop(session) for _ in range(in_flight)))
        return done / (time.monotonic() - started)


async def overload(port: int, rate_per_s: float, seconds: float, seed: int,
                   same_prompt: bool = False) -> list[tuple[str, int, float]]:
    """(tier, status, seconds to the answer) of each request of a Poisson stream."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    rng = random.Random(seed)
    results: list[tuple[str, int, float]] = []
    tiers, weights = list(TIERS), list(TIERS.values())

    async def one(session: aiohttp.ClientSession, tier: str, index: int) -> None:
        started = time.monotonic()
        try:
            async with session.post(url, json=body(None if same_prompt else index),
                                    headers={"authorization": f"Bearer key-{tier}"}) as response:
                await response.read()
                status = response.status
        except (aiohttp.ClientError, asyncio.TimeoutError):
            status = 0
        results.append((tier, status, time.monotonic() - started))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = []
        at_s = 0.0
        started = time.monotonic()
        while at_s < seconds and len(tasks) < 100_000:
            at_s += rng.expovariate(rate_per_s)
            delay_s = started + at_s - time.monotonic()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            tasks.append(asyncio.create_task(one(session, rng.choices(tiers, weights)[0], len(tasks))))
        await asyncio.gather(*tasks)
    return results


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarise(label: str, results: list[tuple[str, int, float]]) -> None:
    print(f"{label}:")
    print("  tier        requests  served  refused  refusal p50   p99    refused after >= 1 s")
    for tier in [*TIERS, "all"]:
        mine = [r for r in results if tier in ("all", r[0])]
        refused = [seconds for _, status, seconds in mine if status in (429, 503)]
        late = sum(1 for seconds in refused if seconds >= 1.0)
        served = sum(1 for _, status, _ in mine if status == 200)
        print(f"  {tier:10s} {len(mine):9d} {served:7d} {len(refused):8d} {1000 * percentile(refused, 0.5):9.1f} ms "
              f"{1000 * percentile(refused, 0.99):7.0f} ms {late:6d} ({100.0 * late / max(1, len(refused)):.1f} %)")
    other = sorted({status for _, status, _ in results} - {200, 429, 503})
    if other:
        print(f"  other statuses: {other}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--overload", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--src-before", default=None, help="a checkout whose src/ runs first, for comparison")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--same-prompt", action="store_true", help="every request the same bytes (see above)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="refusal-bench-"))
    variants = [("this code", None)]
    if args.src_before:
        variants.insert(0, ("before", str(Path(args.src_before) / "src")))
    rate: float | None = None  # measured once, on the first variant, so that both get the same load
    for label, src in variants:
        process, port = start_gateway(workdir, src)
        try:
            if rate is None:
                rate = asyncio.run(capacity(port))
            print(f"[{label}] capacity {rate:.1f} req/s; offering {args.overload:.0f}x = {args.overload * rate:.1f} "
                  f"req/s for {args.seconds:.0f} s")
            results = asyncio.run(overload(port, args.overload * rate, args.seconds, args.seed, args.same_prompt))
            summarise(f"[{label}]", results)
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
