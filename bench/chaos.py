"""Chaos bars, measured: three experiments against `tidegate serve` over five mock replicas.

    python bench/chaos.py [--overload-control] [--only kill,outliers,restart,embedded,embedded-kill20] [--latency-factor X]
                          [--embedded-pairs N]

Starts what it measures: five `tidegate mock-upstream` replicas (50 ms to the first token, 10 ms
between tokens, 16 tokens: 0.2 s per answer), one `tidegate serve` per scenario over them (each
backend `slot_limit: 2`, so the pool holds 10 requests: capacity = 10 / 0.2 s = 50 requests/s, 40/s
once one replica of five is gone), and, for scenario 2, two `tidegate chaos proxy` processes. Load comes
from the project's load generator through the chaos runner (`tidegate.chaos.runner.run_experiment`),
open loop (Poisson), streaming chat, on loopback only.

1. kill: load at 80 % of the five replicas' capacity (40/s: 100 % of the four left after the kill);
   SIGKILL one replica of five at 5 s, restart it at 25 s. Bars: success >= 99.5 % of all requests, 0 hung.
   Streams that were running on the killed replica are counted apart: the gateway continues them on
   another replica (mid-stream failover, `gateway/failover.py`); its `tidegate_stream_failovers_total`
   says how many were failed over (resumed) and how many failed, the load how many the clients saw fail.
2. outliers: load at 70 % of what the pool can serve once the outliers are known (21.6/s of 30.9/s:
   three healthy replicas and the slow one; 43 % of the five's 50/s); from 5 s one replica (behind a
   fault proxy) answers 500 to 30 % of API requests and another (behind a second proxy) gets 2 s
   added before each API request, both to the end. Bars: success >= 99.5 %; each outlier's share of
   the requests the replicas received from 10 s after the faults began to the end < 5 % (mocks'
   `mock_api_requests_total`, plus the errors the proxy injected for the 500 replica, which never
   reach its mock); retries <= 10 % of requests
   (`tidegate_upstream_retries_total`).
3. restart: a gateway with `server: {reuse_port: true, shutdown_delay_s: 1}` under 70 % load (35/s);
   at 6 s a second gateway starts on the same port, once its /ready answers 200 the first gets SIGTERM.
   Bars: 0 requests failed or refused from the second gateway's start to the end; every request in
   flight at SIGTERM finished.

4. embedded (gateway/spares.py): two `tidegate engine` workers serving at 70 % of their measured capacity
   (measured in the first arm; the same load in every arm), one SIGKILLed at 5 s; run without a spare
   and with `spare: 1`, in pairs (`--embedded-pairs N`, default 1, run ABBA). Bars: with the spare,
   less time with fewer than two workers taking traffic than without; and a smaller slowdown from
   the kill: each arm's median end-to-end time of the requests sent from the kill until the worker
   restarted without a spare served again, over the same arm's median before the kill (a ratio
   within one run, so the machine's speed in that run cancels), spare over no spare < 1 (median of
   the pairs). Also printed: the whole runs' medians (the former bar, which machine drift between
   two runs decided), success and served work of each arm, each worker's CPU (share of a core, the
   nice values of its threads) before the kill and while the killed worker's replacement loaded, and
   how long that load took (`bench/chaos_cpu.py`; the replacement is followed up to 60 s past the load).

5. embedded-kill20 (bench/chaos_embedded_kill.py): five `tidegate engine` workers, no spare, streaming load
   at 70 % of their measured capacity; one (20 %) SIGKILLed at 4 s. Bar: success >= 99.5 %.

The scenarios live in bench/chaos_mocks.py, bench/chaos_embedded.py and bench/chaos_embedded_kill.py, shared parts in bench/chaos_kit.py.
`--latency-factor X` turns on the latency outlier rule (`health.latency_factor`) for the mock scenarios.

The gateways run with `overload_control: false` (static slot limits: the capacity above is the real one)
unless `--overload-control` is given.

Each scenario is bounded (<= 45 s of load); the whole run takes about 4 minutes. Exit status 1
when a bar is missed.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

from chaos_embedded import scenario_embedded
from chaos_embedded_kill import scenario_embedded_kill20
from chaos_kit import (CAPACITY_RPS, ITL_MS, REPLICAS, RESULTS, SERVICE_S, SLOT_LIMIT, TOKENS, TTFT_MS, BenchOptions,
                       Processes, free_port, mock_argv, wait_ok)
from chaos_mocks import scenario_kill, scenario_outliers, scenario_restart

SCENARIOS = ("kill", "outliers", "restart", "embedded", "embedded-kill20")


async def main(options: BenchOptions, only: tuple[str, ...]) -> int:
    started = time.monotonic()
    log_dir = Path(tempfile.mkdtemp(prefix="tidegate-bench-chaos-"))
    procs = Processes(log_dir)
    print(f"chaos bench: {REPLICAS} mock replicas ({TTFT_MS} ms TTFT, {ITL_MS} ms ITL, {TOKENS} tokens = "
          f"{SERVICE_S:g} s/answer), gateway slot_limit {SLOT_LIMIT} per replica -> capacity {CAPACITY_RPS:g} req/s; "
          f"overload_control {'on' if options.overload_control else 'off'}; latency_factor "
          f"{options.latency_factor or 'off'}; {os.cpu_count()} CPUs; logs in {log_dir}")
    try:
        mocks = [free_port() for _ in range(REPLICAS)]
        if set(only) & {"kill", "outliers", "restart"}:
            for port in mocks:
                procs.start(f"mock-{port}", *mock_argv(port), ready_url=f"http://127.0.0.1:{port}/health")
        if "kill" in only:
            await asyncio.wait_for(scenario_kill(options, procs, mocks, log_dir), 90)
            for port in mocks:  # the restarted replica is back
                wait_ok(f"http://127.0.0.1:{port}/health")
        if "outliers" in only:
            await asyncio.wait_for(scenario_outliers(options, procs, mocks, log_dir), 90)
        if "restart" in only:
            await asyncio.wait_for(scenario_restart(options, procs, mocks, log_dir), 90)
        if "embedded" in only:
            await asyncio.wait_for(scenario_embedded(options, procs, log_dir), 600 * options.embedded_pairs)
        if "embedded-kill20" in only:
            await asyncio.wait_for(scenario_embedded_kill20(options, procs, log_dir), 600)
    finally:
        procs.stop_all()
    failed = [label for label, ok in RESULTS if not ok]
    print(f"\n{len(RESULTS) - len(failed)} of {len(RESULTS)} bars passed in {time.monotonic() - started:.0f} s"
          + (f"; missed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def _parse(argv: list[str]) -> tuple[BenchOptions, tuple[str, ...]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--overload-control", action="store_true", help="gateways with overload control on")
    parser.add_argument("--only", default=",".join(SCENARIOS), help=f"comma-separated subset of {','.join(SCENARIOS)}")
    parser.add_argument("--latency-factor", type=float, default=None,
                        help="health.latency_factor for the mock scenarios (the latency outlier rule; off by default)")
    parser.add_argument("--embedded-pairs", type=int, default=1,
                        help="pairs of arms (without, with a spare) of the embedded scenario, run ABBA (default 1)")
    args = parser.parse_args(argv)
    only = tuple(name.strip() for name in args.only.split(",") if name.strip())
    unknown = set(only) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    if args.embedded_pairs < 1:
        parser.error("--embedded-pairs must be at least 1")
    return BenchOptions(args.overload_control, args.latency_factor, args.embedded_pairs), only


if __name__ == "__main__":
    sys.exit(asyncio.run(main(*_parse(sys.argv[1:]))))
