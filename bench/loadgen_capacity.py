"""How many requests/s can `tidegate bench` offer on ONE core, and does it notice when it cannot?

Bars (issue 4): >= 2,000 requests/s non-streaming and >= 1,000 streams/s, generator pinned to
core 0, mock upstream pinned to core 1. Baseline in the same run: the same open-loop schedule sent
with aiohttp's client, which is why loadgen/http_client.py exists.

Run: flock /tmp/tidegate-bench.lock python bench/loadgen_capacity.py [--seconds 5]
A level is "sustained" when every request was sent and completed OK, the achieved send rate is
within 2 % of the offered one, the p99 send lag is under 10 ms and the p99 end-to-end latency stays
within 20 ms of the mock's configured 16 ms (a saturated client delays reading responses, which
shows up there). The open loop spins between sends for precise timing, so CPU % is always ~100
and says nothing about headroom; latency and lag do.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from pinned_mock import start_pinned_mock  # noqa: E402
from tidegate.loadgen.arrivals import Constant  # noqa: E402
from tidegate.loadgen.driver import Driver, RunConfig  # noqa: E402
from tidegate.loadgen.http_client import parse_url  # noqa: E402
from tidegate.loadgen.mix import DEFAULT_TENANT, parse_length  # noqa: E402
from tidegate.loadgen.plan import TrafficStream, build_plan  # noqa: E402
from tidegate.loadgen.records import ApiKind  # noqa: E402
from tidegate.loadgen.stats import lag_summary  # noqa: E402

GENERATOR_CORE, MOCK_CORE = 0, 1
MOCK_TOKENS, MOCK_TTFT_MS, MOCK_ITL_MS = 16, 1.0, 1.0
MOCK_E2E_MS = MOCK_TTFT_MS + (MOCK_TOKENS - 1) * MOCK_ITL_MS


@dataclass(frozen=True)
class Level:
    client: str
    stream: bool
    offered_rps: float
    sent: int
    ok: int
    send_rate_rps: float
    lag_p50_ms: float
    lag_p99_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    behind_flagged: bool
    mock_cpu_pct: float  # near 100: the mock, not the generator, is the limit

    @property
    def sustained(self) -> bool:
        return (self.ok == self.sent and abs(self.send_rate_rps / self.offered_rps - 1) < 0.02
                and self.lag_p99_ms < 10.0 and self.e2e_p99_ms < MOCK_E2E_MS + 20.0)


def raise_fd_limit() -> None:
    """An open loop at thousands of requests/s needs more sockets than the usual 1,024 default."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def start_mock(port: int) -> subprocess.Popen:
    return start_pinned_mock(MOCK_CORE, port, "--tokens", str(MOCK_TOKENS), "--ttft-ms", str(MOCK_TTFT_MS),
                             "--itl-ms", str(MOCK_ITL_MS))


def _plan(rate: float, seconds: float):
    stream = TrafficStream(Constant(rate), (DEFAULT_TENANT,), parse_length("const:64"), parse_length("const:16"))
    return build_plan([stream], np.random.default_rng(0), duration_s=seconds)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def measured(run, mock_pid: int, *args) -> Level:
    cpu0, t0 = _cpu_s(mock_pid), time.perf_counter()
    level = run(*args)
    mock_pct = 100 * (_cpu_s(mock_pid) - cpu0) / (time.perf_counter() - t0)
    return Level(**{**level.__dict__, "mock_cpu_pct": mock_pct})


def run_tidegate(url: str, rate: float, seconds: float, stream: bool) -> Level:
    plan = _plan(rate, seconds)
    config = RunConfig(targets=(parse_url(url),), kind=ApiKind.CHAT, stream=stream, timeout_s=30.0)
    result = uvloop.run(Driver(config, plan).run())
    sends = np.asarray([r.sent_s for r in result.records])
    lag = lag_summary(result.records, threshold_ms=10.0)
    e2e_p50, e2e_p99 = np.percentile([(r.e2e_s or np.inf) * 1000 for r in result.records], [50, 99],
                                     method="nearest")
    return Level("tidegate raw", stream, rate, len(result.records), sum(r.ok for r in result.records),
                 (len(sends) - 1) / (sends.max() - sends.min()), lag.p50_ms or 0.0, lag.p99_ms or 0.0,
                 float(e2e_p50), float(e2e_p99), lag.behind_schedule, 0.0)


async def _aiohttp_open_loop(url: str, plan, stream: bool) -> tuple[list[float], list[float], list[float], int]:
    """The same schedule and spin as Driver._open_loop; lag taken where the request starts."""
    import aiohttp
    import orjson

    lags: list[float] = []
    sends: list[float] = []
    e2es: list[float] = []
    ok = 0

    async def one(body: bytes, due: float) -> None:
        nonlocal ok
        sent = time.perf_counter()
        lags.append(sent - due)
        sends.append(sent)
        try:
            async with session.post(f"{url}/v1/chat/completions", data=body,
                                    headers={"Content-Type": "application/json"}) as response:
                if stream:  # the same per-event work a measuring generator must do: timestamp + parse
                    events = []
                    async for line in response.content:
                        if line.startswith(b"data: {"):
                            events.append((time.perf_counter(), orjson.loads(line[6:])))
                else:
                    await response.read()
                ok += response.status == 200
        except (aiohttp.ClientError, OSError):
            return  # counted as not ok; e2e missing counts as infinite
        e2es.append(time.perf_counter() - sent)

    connector = aiohttp.TCPConnector(limit=0)  # no pool cap: open loop must not queue in the client
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = set()
        start = time.perf_counter()
        for request in plan:
            due = start + request.send_at_s
            while (wait := due - time.perf_counter()) > 0:
                await asyncio.sleep(wait - 0.002 if wait > 0.002 else 0)
            body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * request.prompt_tokens}],
                                 "max_tokens": request.max_tokens, "stream": stream})
            task = asyncio.create_task(one(body, due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*list(tasks), return_exceptions=True)
    return lags, sends, e2es, ok


def run_aiohttp(url: str, rate: float, seconds: float, stream: bool) -> Level:
    plan = _plan(rate, seconds)
    lags, sends, e2es, ok = uvloop.run(_aiohttp_open_loop(url, plan, stream))
    p50, p99 = np.percentile(np.asarray(lags) * 1000, [50, 99])
    e2e_p50, e2e_p99 = np.percentile(np.asarray(e2es + [np.inf] * (len(plan) - len(e2es))) * 1000, [50, 99],
                                     method="nearest")
    return Level("aiohttp", stream, rate, len(plan), ok, (len(sends) - 1) / (max(sends) - min(sends)),
                 float(p50), float(p99), float(e2e_p50), float(e2e_p99), bool(p99 > 10.0), 0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--port", type=int, default=18471)
    args = parser.parse_args()
    os.sched_setaffinity(0, {GENERATOR_CORE})
    raise_fd_limit()
    url = f"http://127.0.0.1:{args.port}"
    levels: list[Level] = []
    mock = start_mock(args.port)
    try:
        for stream, rates in ((False, (2000, 4000, 8000, 12000)), (True, (1000, 2000, 4000, 6000))):
            for rate in rates:  # alternate clients level by level, so drift in machine load hits both
                levels.append(measured(run_aiohttp, mock.pid, url, rate, args.seconds, stream))
                levels.append(measured(run_tidegate, mock.pid, url, rate, args.seconds, stream))
    finally:
        mock.terminate()
        mock.wait(10)
    print(f"generator on core {GENERATOR_CORE} (1 thread, uvloop), mock on core {MOCK_CORE}; "
          f"{args.seconds:g} s per level; mock: {MOCK_TOKENS} tokens, TTFT {MOCK_TTFT_MS:g} ms, ITL {MOCK_ITL_MS:g} ms")
    print(f"{'client':13} {'mode':6} {'offered':>8} {'sent':>6} {'ok':>6} {'send/s':>8} {'lag p50':>8} "
          f"{'lag p99':>8} {'e2e p50':>8} {'e2e p99':>8} {'flagged':>7} {'mock cpu%':>9} sustained")
    for level in levels:
        print(f"{level.client:13} {'stream' if level.stream else 'whole':6} {level.offered_rps:8.0f} {level.sent:6d} "
              f"{level.ok:6d} {level.send_rate_rps:8.0f} {level.lag_p50_ms:8.2f} {level.lag_p99_ms:8.2f} "
              f"{level.e2e_p50_ms:8.2f} {level.e2e_p99_ms:8.2f} {str(level.behind_flagged):>7} {level.mock_cpu_pct:9.0f} {level.sustained}")

    def best(client: str, stream: bool) -> float:
        return max((lv.offered_rps for lv in levels if lv.client == client and lv.stream == stream and lv.sustained),
                   default=0.0)

    for stream, bar in ((False, 2000), (True, 1000)):
        raw, base = best("tidegate raw", stream), best("aiohttp", stream)
        ratio = f"{raw / base:.2f}x aiohttp" if base else "aiohttp sustained no level"
        print(f"{'streaming' if stream else 'non-streaming'}: highest sustained {raw:.0f}/s "
              f"(bar {bar}/s: {'MET' if raw >= bar else 'NOT MET'}); {ratio} ({base:.0f}/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
