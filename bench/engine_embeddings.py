"""Embeddings throughput of the embedded engine: 64 concurrent clients vs 1 (bar: >= 3x).

Starts a real `tidegate engine --model all-MiniLM-L6-v2` process and drives POST /v1/embeddings
over loopback, one text per request, for two fixed workloads: short queries (4-24 words) and
queries mixed with passages (4-120 words). Long texts already keep the CPU busy one at a time, so
batching gains less on the mixed workload. `--server bench-app` serves the same routes from a
small aiohttp app instead (a subprocess, so that clients and model do not share a GIL).
Then, in-process, the batcher with length-sorted vs arrival-order batches: throughput and the
fraction of computed token positions that were padding.

Run: python bench/engine_embeddings.py [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request

from tidegate.ports import free_port

MODEL = "all-MiniLM-L6-v2"
WORDS = ("the model server batches requests from many clients so that the processor computes "
         "them together while each client waits only a little longer for its own answer during "
         "surges of traffic when queues grow and latency budgets shrink").split()


# name -> (fewest, most) words per text
WORKLOADS = {"short queries (4-24 words)": (4, 24), "mixed queries and passages (4-120 words)": (4, 120)}


def workload(count: int, seed: int = 7, words: tuple[int, int] = (4, 120)) -> list[str]:
    """Fixed texts of varied length, as embedding traffic has."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))) for _ in range(count)]


# ---------------------------------------------------------------- server side
def serve_bench_app(port: int, threads: int) -> None:
    from aiohttp import web

    from tidegate.engine.embeddings import EmbeddingBatcher, EmbeddingModel
    from tidegate.engine.embeddings_api import make_embeddings_routes

    async def main() -> None:
        model = EmbeddingModel.load(MODEL, threads=threads)
        batcher = EmbeddingBatcher(model)
        await batcher.start()
        app = web.Application()
        app.add_routes(make_embeddings_routes(batcher, MODEL))
        app.add_routes([web.get("/health", lambda _request: web.json_response({"status": "ok"}))])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    run_async(main())


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def start_server(kind: str, threads: int) -> tuple[subprocess.Popen, str, str]:
    """Returns (process, base url, what it is); `kind` "auto" prefers the real engine."""
    kinds = ["engine", "bench-app"] if kind == "auto" else [kind]
    if "engine" in kinds and importlib.util.find_spec("tidegate.engine.cli") is None:
        kinds.remove("engine")
    for candidate in kinds:
        port = free_port()
        if candidate == "engine":
            argv = [sys.executable, "-m", "tidegate", "engine", "--model", MODEL, "--port", str(port),
                    "--threads", str(threads)]
        else:
            argv = [sys.executable, __file__, "--serve-port", str(port), "--threads", str(threads)]
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        if wait_ready(base + "/health", process) and _serves_embeddings(base):
            return process, base, "tidegate engine" if candidate == "engine" else "bench-app"
        stop(process)
        print(f"  ({candidate} did not serve /v1/embeddings; trying the next server)")
    raise SystemExit("no server could serve /v1/embeddings")


def _serves_embeddings(base: str) -> bool:
    request = urllib.request.Request(base + "/v1/embeddings", data=b'{"model": "%s", "input": "probe"}' % MODEL.encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status == 200
    except OSError:
        return False


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


# ---------------------------------------------------------------- client side
async def http_throughput(base: str, texts: list[str], clients: int, max_s: float, max_requests: int = 50_000) -> float:
    """Texts/s over loopback with `clients` closed-loop clients, bounded in count and time."""
    import aiohttp
    import orjson

    bodies = [orjson.dumps({"model": MODEL, "input": text}) for text in texts]
    counter = itertools.count()
    completed = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as session:
        async def client(deadline: float) -> None:
            nonlocal completed
            while time.perf_counter() < deadline and (i := next(counter)) < max_requests:
                async with session.post(base + "/v1/embeddings", data=bodies[i % len(bodies)],
                                        headers={"Content-Type": "application/json"}) as response:
                    await response.read()
                    if response.status != 200:
                        raise RuntimeError(f"HTTP {response.status}")
                completed += 1

        start = time.perf_counter()
        await asyncio.gather(*(client(start + max_s) for _ in range(clients)))
        return completed / (time.perf_counter() - start)


async def batcher_run(model, texts: list[str], sort_by_length: bool, clients: int, max_s: float):
    from tidegate.engine.embeddings import EmbeddingBatcher

    batcher = EmbeddingBatcher(model, sort_by_length=sort_by_length)
    await batcher.start()
    counter = itertools.count()
    start = time.perf_counter()

    async def client() -> None:
        while time.perf_counter() < start + max_s and (i := next(counter)) < len(texts):
            await batcher.embed([texts[i]])

    try:
        await asyncio.gather(*(client() for _ in range(clients)))
        elapsed = time.perf_counter() - start
        stats = batcher.stats()
    finally:
        await batcher.close()
    return stats.texts / elapsed, stats


def _rates(values: list[float]) -> str:
    return ", ".join(f"{value:.0f}" for value in values)


def run_async(coroutine):  # type: ignore[no-untyped-def]
    try:
        import uvloop  # as the engine runs: less client overhead on a machine the server shares

        return uvloop.run(coroutine)
    except ImportError:
        return asyncio.run(coroutine)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of the server")
    parser.add_argument("--server", choices=["auto", "engine", "bench-app"], default="auto")
    parser.add_argument("--seconds", type=float, default=4.0, help="per slice of a measurement")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved slices per measurement")
    parser.add_argument("--serve-port", type=int, help=argparse.SUPPRESS)  # internal: bench-app mode
    args = parser.parse_args()
    # as `tidegate engine` does: the worker thread re-takes the GIL after each torch op
    sys.setswitchinterval(0.0005)
    if args.serve_port:
        serve_bench_app(args.serve_port, args.threads)
        return 0

    print(f"machine: {os.cpu_count()} CPUs; server torch threads: {args.threads}")
    print(f"each figure: median of {args.rounds} interleaved slices of {args.seconds:g} s, so that other "
          "load on the machine hurts both sides of a ratio alike")
    process, base, what = start_server(args.server, args.threads)
    print(f"server: {what} ({MODEL}, default dtype), one text per request")
    try:
        for label, words in WORKLOADS.items():
            texts = workload(4096, words=words)
            # warm up at full concurrency: oneDNN builds kernels for each new batch shape on first use
            run_async(http_throughput(base, texts, clients=64, max_s=3.0))
            one, many = [], []
            for _ in range(args.rounds):
                one.append(run_async(http_throughput(base, texts, clients=1, max_s=args.seconds)))
                many.append(run_async(http_throughput(base, texts, clients=64, max_s=args.seconds)))
            ratio = statistics.median(many) / statistics.median(one)
            print(f"  {label}:")
            print(f"    1 client:    {statistics.median(one):8.1f} texts/s  (slices: {_rates(one)})")
            print(f"    64 clients:  {statistics.median(many):8.1f} texts/s  (slices: {_rates(many)})")
            print(f"    ratio 64/1:  {ratio:8.2f}x   (bar >= 3x: {'PASS' if ratio >= 3 else 'FAIL'})")
    finally:
        stop(process)

    import torch

    from tidegate.engine.embeddings import EmbeddingModel

    model = EmbeddingModel.load(MODEL, threads=args.threads)
    texts = workload(4096)
    print(f"in-process batcher, 64 clients, mixed texts, {model.precision}, torch threads {torch.get_num_threads()}:")
    rates: dict[bool, list[float]] = {True: [], False: []}
    waste: dict[bool, float] = {}
    batch: dict[bool, float] = {}
    for _ in range(args.rounds):
        for sort_by_length in (True, False):
            rate, stats = run_async(batcher_run(model, texts, sort_by_length, clients=64, max_s=args.seconds))
            rates[sort_by_length].append(rate)
            waste[sort_by_length], batch[sort_by_length] = stats.padding_waste, stats.texts / max(stats.batches, 1)
    for sort_by_length in (True, False):
        label = "sorted by length" if sort_by_length else "arrival order   "
        print(f"  {label}: {statistics.median(rates[sort_by_length]):8.1f} texts/s, padding waste "
              f"{waste[sort_by_length]:5.1%}, mean batch {batch[sort_by_length]:.1f} texts  "
              f"(slices: {_rates(rates[sort_by_length])})")
    print(f"  sorted/unsorted throughput: {statistics.median(rates[True]) / statistics.median(rates[False]):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
