"""Does `tidegate bench` measure what is there, and replay a trace as it was?

1. Latency: against the mock upstream with known TTFT / inter-token distributions (const, exp,
   lognormal, uniform), the reported P50/P90/P99 must be within 5 % (or 0.5 ms) of the analytic
   percentiles of the configured distribution. Also printed: the sampling noise expected from the
   sample size alone (std of the empirical quantile over 200 simulated runs of the same size).
2. Trace replay of the Azure LLM inference trace 2023 (from Patel et al., Splitwise, ISCA 2024):
   inter-arrival times (after --speedup) within 1 % on average and per-minute counts exactly,
   both in the schedule and in the achieved send times of a real run against the mock.

Run: flock /tmp/tidegate-bench.lock python bench/loadgen_accuracy.py
Generator pinned to core 0, mock to core 1.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from pinned_mock import start_pinned_mock  # noqa: E402
from tidegate.loadgen.arrivals import Poisson  # noqa: E402
from tidegate.loadgen.driver import Driver, RunConfig  # noqa: E402
from tidegate.loadgen.http_client import parse_url  # noqa: E402
from tidegate.loadgen.mix import DEFAULT_TENANT, parse_length  # noqa: E402
from tidegate.loadgen.plan import TrafficStream, build_plan, plan_from_trace  # noqa: E402
from tidegate.loadgen.records import ApiKind  # noqa: E402
from tidegate.loadgen.stats import Slo, lag_summary, summarize  # noqa: E402
from tidegate.loadgen.trace import AZURE_TRACE_CREDIT, default_trace_path, load_azure_trace, per_minute_counts  # noqa: E402
from tidegate.mock.latency import Distribution, LatencyModel  # noqa: E402

GENERATOR_CORE, MOCK_CORE = 0, 1
QUANTILES = (0.5, 0.9, 0.99)
TTFT_MS, ITL_MS, SIGMA, TOKENS = 50.0, 20.0, 0.5, 16
MAX_ATTEMPTS, DISTURBED_LAG_MS = 3, 2.0


def start_mock(port: int, *args: str) -> subprocess.Popen:
    return start_pinned_mock(MOCK_CORE, port, *args)


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    process.wait(10)


def sampling_noise_pct(model: LatencyModel, q: float, n: int, rng: np.random.Generator) -> float:
    """Relative std of the empirical q-quantile of n draws: what no generator can do better than."""
    uniform = rng.random((200, n))
    # inverse-CDF draws through the model's own quantile function (vectorised over a grid)
    grid = np.linspace(0.0005, 0.9995, 2000)
    table = np.array([model.quantile_s(g) for g in grid])
    draws = np.interp(uniform, grid, table)
    estimates = np.quantile(draws, q, axis=1)
    return 100 * float(estimates.std() / model.quantile_s(q))


def latency_accuracy(port: int, rate: float, seconds: float) -> bool:
    print(f"== latency: mock TTFT mean {TTFT_MS:g} ms, ITL mean {ITL_MS:g} ms, sigma {SIGMA:g}, {TOKENS} tokens; "
          f"Poisson {rate:g}/s for {seconds:g} s, streaming chat")
    print(f"{'dist':9} {'metric':5} {'q':>5} {'analytic':>9} {'measured':>9} {'error':>8} {'noise':>7} verdict")
    all_ok = True
    rng = np.random.default_rng(0)
    for dist in ("const", "exp", "lognormal", "uniform"):
        for attempt in range(1, MAX_ATTEMPTS + 1):
            mock = start_mock(port, "--precise-timing", "--tokens", str(TOKENS), "--ttft-ms", str(TTFT_MS), "--itl-ms", str(ITL_MS),
                              "--ttft-dist", dist, "--itl-dist", dist, "--sigma", str(SIGMA), "--seed", "7")
            try:
                stream = TrafficStream(Poisson(rate), (DEFAULT_TENANT,), parse_length("const:64"),
                                       parse_length(f"const:{TOKENS}"))
                plan = build_plan([stream], np.random.default_rng(1), duration_s=seconds)
                config = RunConfig(targets=(parse_url(f"http://127.0.0.1:{port}"),), kind=ApiKind.CHAT, stream=True)
                result = uvloop.run(Driver(config, plan).run())
            finally:
                stop(mock)
            # The generator's own send lag tells when another process took the cores (the machine
            # is shared): then the latencies measure that process, not the mock. Run again.
            lag_p99_ms = lag_summary(result.records, 10.0).p99_ms
            if lag_p99_ms < DISTURBED_LAG_MS:
                break
            print(f"{dist:9} attempt {attempt} disturbed (send lag p99 {lag_p99_ms:.1f} ms): discarded")
        ok_records = [r for r in result.records if r.ok]
        samples = {
            "ttft": np.asarray([r.ttft_s for r in ok_records]),
            "itl": np.asarray([gap for r in ok_records for gap in r.itl_s]),
        }
        models = {"ttft": LatencyModel(TTFT_MS / 1000, Distribution(dist), SIGMA),
                  "itl": LatencyModel(ITL_MS / 1000, Distribution(dist), SIGMA)}
        for metric in ("ttft", "itl"):
            for q in QUANTILES:
                analytic = models[metric].quantile_s(q) * 1000
                measured = float(np.quantile(samples[metric], q)) * 1000
                error = measured - analytic
                ok = abs(error) <= max(0.05 * analytic, 0.5)
                all_ok &= ok
                noise = sampling_noise_pct(models[metric], q, len(samples[metric]), rng) if dist != "const" else 0.0
                print(f"{dist:9} {metric:5} {q:5.2f} {analytic:9.2f} {measured:9.2f} {100 * error / analytic:+7.2f}% "
                      f"{noise:6.2f}% {'ok' if ok else 'MISS'}")
        if dist == "const":
            # the reference is the mock; --precise-timing paces its tokens to well under a millisecond
            print(f"{'':9} note: the mock paces tokens with --precise-timing; without it, its 1 ms timer tick alone "
                  f"would show a constant {ITL_MS:g} ms gap as a triangular +-1 ms (p99 +0.86 ms)")
        print(f"{'':9} ({len(result.records)} requests, {len(ok_records)} ok, {len(samples['itl'])} ITL samples, "
              f"send lag p99 {lag_summary(result.records, 10.0).p99_ms:.2f} ms)")
    return all_ok


def trace_accuracy(port: int, speedup: float) -> bool:
    path = default_trace_path()
    if not path.exists():
        print(f"== trace: {path} not found (set TIDEGATE_TRACE); skipped")
        return False
    trace = load_azure_trace(path)
    print(f"== trace replay: {AZURE_TRACE_CREDIT}; {len(trace)} requests over {trace.offsets_s[-1] / 60:.1f} min")
    minute_s = 60.0 / speedup
    expected_counts = per_minute_counts(trace.offsets_s)
    expected_gaps = np.diff(trace.offsets_s) / speedup
    scaled = trace.scaled(np.random.default_rng(0), speedup=speedup)
    plan = plan_from_trace(scaled, (DEFAULT_TENANT,), np.random.default_rng(0), max_tokens=parse_length("const:4"))
    planned = np.asarray([p.send_at_s for p in plan])
    plan_gap_err = abs(np.diff(planned).mean() / expected_gaps.mean() - 1) * 100
    plan_counts_equal = np.array_equal(per_minute_counts(planned, minute_s), expected_counts)
    print(f"schedule (speedup {speedup:g}): mean inter-arrival error {plan_gap_err:.4f} %, "
          f"per-minute counts equal: {plan_counts_equal}")
    for rate_scale in (0.5, 2.0):
        thinned = trace.scaled(np.random.default_rng(1), speedup=speedup, rate_scale=rate_scale)
        ratio = per_minute_counts(thinned.offsets_s, minute_s)[: len(expected_counts)] / expected_counts
        print(f"schedule (rate scale {rate_scale:g}): {len(thinned)} requests ({len(thinned) / len(trace):.3f}x), "
              f"per-minute count ratio median {np.median(ratio):.3f} (min {ratio.min():.3f}, max {ratio.max():.3f})")

    mock = start_mock(port, "--tokens", "4", "--ttft-ms", "2", "--itl-ms", "1")
    try:
        config = RunConfig(targets=(parse_url(f"http://127.0.0.1:{port}"),), kind=ApiKind.CHAT, stream=False)
        result = uvloop.run(Driver(config, plan).run())
    finally:
        stop(mock)
    sent = np.asarray([r.sent_s for r in result.records])  # records come back sorted by index = schedule order
    achieved_gaps = np.diff(sent)
    mean_gap_err = abs(achieved_gaps.mean() / expected_gaps.mean() - 1) * 100
    per_gap_err = np.abs(achieved_gaps - expected_gaps).mean() / expected_gaps.mean() * 100
    # sent_s and send_at_s share the run's start as origin
    achieved_counts = per_minute_counts(sent, minute_s)
    crossed = np.flatnonzero(np.floor(sent / minute_s) != np.floor(planned / minute_s))
    differing = int(np.sum(achieved_counts[: len(expected_counts)] != expected_counts[: len(achieved_counts)]))
    counts_equal = np.array_equal(achieved_counts, expected_counts)
    lag = lag_summary(result.records, 10.0)
    summary = summarize(result.records, target=0, tier="all", elapsed_s=result.elapsed_s, slo=Slo())
    print(f"achieved ({len(result.records)} sent, {summary.succeeded} ok, {result.elapsed_s:.1f} s): "
          f"mean inter-arrival error {mean_gap_err:.4f} %, mean |per-gap error| {per_gap_err:.2f} % of the mean gap, "
          f"per-minute counts equal: {counts_equal} ({differing} of {len(expected_counts)} minutes differ, "
          f"max diff {int(np.abs(achieved_counts[:len(expected_counts)] - expected_counts[:len(achieved_counts)]).max())}); "
          f"send lag p50/p99/max {lag.p50_ms:.3f}/{lag.p99_ms:.3f}/{lag.max_ms:.3f} ms")
    for index in crossed:
        print(f"  request {index}: due {planned[index]:.6f} s, sent {sent[index]:.6f} s "
              f"(lag {1000 * (sent[index] - planned[index]):.3f} ms, "
              f"{1000 * (np.ceil(planned[index] / minute_s) * minute_s - planned[index]):.3f} ms before its minute ended)")
    return plan_gap_err < 1 and plan_counts_equal and mean_gap_err < 1 and counts_equal


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=18472)
    parser.add_argument("--rate", type=float, default=400.0)
    parser.add_argument("--seconds", type=float, default=25.0)
    parser.add_argument("--speedup", type=float, default=60.0)
    parser.add_argument("--only", choices=["latency", "trace"], help="run one half")
    args = parser.parse_args()
    os.sched_setaffinity(0, {GENERATOR_CORE})
    latency_ok = latency_accuracy(args.port, args.rate, args.seconds) if args.only != "trace" else None
    trace_ok = trace_accuracy(args.port, args.speedup) if args.only != "latency" else None
    def verdict(ok: bool | None) -> str:
        return "not run" if ok is None else ("MET" if ok else "NOT MET")

    print(f"latency bar (5 % or 0.5 ms): {verdict(latency_ok)}; "
          f"trace bar (1 % mean inter-arrival, exact per-minute counts): {verdict(trace_ok)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
