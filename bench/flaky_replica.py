"""Five replicas, one answering 500 to 30 % of its requests, under steady load through one gateway.

    python bench/flaky_replica.py [--seconds 60] [--concurrency 32]

Starts five mock upstreams (`tidegate mock-upstream`, ~20 ms to the first token, 16 tokens) and
`tidegate serve` over them with the default health and retry settings, then drives a closed loop
of streaming and non-streaming chat requests for `--seconds`. Prints client success, the flaky
replica's share of the requests the replicas received in each 5 s window (from the mocks' own
counters), when that share fell below 5 % for good, retries against requests, and the served rate.
Bars: >= 99.5 % of client requests succeed; the flaky replica's share < 5 % within 10 s.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

from gateway_overhead import free_port, wait_ok  # bench/ is the script's directory

WINDOW_S = 5.0



def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        lines = response.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line and line[0] != "#"}


def total(metrics: dict[str, float], prefix: str) -> float:
    return sum(value for name, value in metrics.items() if name.startswith(prefix))


async def drive(url: str, seconds: float, concurrency: int) -> tuple[int, int, dict[int, int]]:
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "Say something."}]}
    ok = failed = 0
    statuses: dict[int, int] = {}
    deadline = time.monotonic() + seconds
    timeout = aiohttp.ClientTimeout(total=30)

    async def client(index: int) -> None:
        nonlocal ok, failed
        async with aiohttp.ClientSession(timeout=timeout) as session:
            sent = 0
            while time.monotonic() < deadline and sent < 1_000_000:
                sent += 1
                stream = (sent + index) % 2 == 0
                try:
                    async with session.post(url, json={**body, "stream": stream}) as response:
                        text = await response.text()
                        good = response.status == 200 and ("[DONE]" in text if stream else '"choices"' in text)
                        good = good and '"error"' not in text
                        statuses[response.status] = statuses.get(response.status, 0) + 1
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    good = False
                if good:
                    ok += 1
                else:
                    failed += 1

    await asyncio.gather(*(client(i) for i in range(concurrency)))
    return ok, failed, statuses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()

    processes: list[subprocess.Popen] = []
    workdir = Path(tempfile.mkdtemp(prefix="flaky-bench-"))
    try:
        ports = [free_port() for _ in range(5)]
        for index, port in enumerate(ports):
            errors = ["--error-rate", "0.3", "--seed", "1"] if index == 4 else []
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "tidegate", "mock-upstream", "--port", str(port), "--tokens", "16",
                 "--ttft-ms", "20", "--itl-ms", "1", *errors], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for port in ports:
            wait_ok(f"http://127.0.0.1:{port}/health")
        gateway_port = free_port()
        backends = "\n".join(f"      - {{type: upstream, url: 'http://127.0.0.1:{port}/v1'}}" for port in ports)
        (workdir / "gateway.yaml").write_text(
            f"server: {{port: {gateway_port}, access_log: false}}\npools:\n  - name: m\n    backends:\n{backends}\n")
        log = open(workdir / "gateway.log", "w")
        processes.append(subprocess.Popen([sys.executable, "-m", "tidegate", "serve", "--config",
                                           str(workdir / "gateway.yaml")], stdout=log, stderr=subprocess.STDOUT))
        wait_ok(f"http://127.0.0.1:{gateway_port}/ready")

        counters = [f"http://127.0.0.1:{port}/metrics" for port in ports]
        samples: list[tuple[float, list[float]]] = []

        async def sample_counters(stop: asyncio.Event) -> None:
            while not stop.is_set():
                values = await asyncio.to_thread(lambda: [total(scrape(u), "mock_requests_total") for u in counters])
                samples.append((time.monotonic(), values))
                try:
                    await asyncio.wait_for(stop.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass

        async def run() -> tuple[int, int, dict[int, int]]:
            stop = asyncio.Event()
            sampler = asyncio.create_task(sample_counters(stop))
            await asyncio.sleep(0.05)
            result = await drive(f"http://127.0.0.1:{gateway_port}/v1/chat/completions", args.seconds,
                                 args.concurrency)
            stop.set()
            await sampler
            return result

        started = time.monotonic()
        ok, failed, statuses = asyncio.run(run())
        elapsed_s = time.monotonic() - started
        gateway_metrics = scrape(f"http://127.0.0.1:{gateway_port}/metrics")

        t0 = samples[0][0]
        print(f"requests: {ok + failed} in {elapsed_s:.1f} s ({(ok + failed) / elapsed_s:.0f}/s), "
              f"succeeded {ok} ({100.0 * ok / max(1, ok + failed):.2f} %), statuses {statuses}")
        print(f"retries {total(gateway_metrics, 'tidegate_upstream_retries_total'):.0f} "
              f"({100.0 * total(gateway_metrics, 'tidegate_upstream_retries_total') / max(1, ok + failed):.2f} "
              f"% of requests); upstream errors {total(gateway_metrics, 'tidegate_upstream_errors_total'):.0f}")
        print("window     flaky share   replicas' requests")
        below_since: float | None = None
        window_start = samples[0]
        for sample in samples[1:]:
            if sample[0] - window_start[0] < WINDOW_S - 0.01 and sample is not samples[-1]:
                continue
            deltas = [after - before for before, after in zip(window_start[1], sample[1])]
            share = deltas[4] / max(1.0, sum(deltas))
            print(f"{window_start[0] - t0:5.1f}-{sample[0] - t0:5.1f} s  {100.0 * share:6.2f} %   {sum(deltas):8.0f}")
            if share < 0.05:
                below_since = window_start[0] - t0 if below_since is None else below_since
            else:
                below_since = None
            window_start = sample
        success = ok / max(1, ok + failed)
        print(f"flaky share below 5 % from t = {below_since if below_since is not None else float('nan'):.1f} s "
              "(and in every window after)")
        bars = [("success >= 99.5 %", success >= 0.995),
                ("flaky share < 5 % within 10 s", below_since is not None and below_since <= 10.0)]
        for name, passed in bars:
            print(f"{'PASS' if passed else 'FAIL'}: {name}")
        return 0 if all(passed for _, passed in bars) else 1
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


if __name__ == "__main__":
    raise SystemExit(main())
