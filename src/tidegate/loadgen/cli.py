"""`tidegate bench`: load-generate against any OpenAI-compatible endpoint and report.

Examples:
  tidegate bench --url http://127.0.0.1:8000 --arrival poisson --rate 50 --duration 30 --out out/
  tidegate bench --url http://127.0.0.1:8000 --arrival trace --speedup 60 --rate-scale 0.5
  tidegate bench --url http://127.0.0.1:8000 --concurrency 16 --requests 2000
  tidegate bench --scenario surge
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tidegate.loadgen import arrivals
from tidegate.loadgen.http_client import Endpoint, parse_url
from tidegate.loadgen.mix import DEFAULT_TENANT, Tenant, load_mix_file, parse_length, parse_tenant
from tidegate.loadgen.plan import PlannedRequest, TrafficStream, build_plan, plan_from_trace
from tidegate.loadgen.records import ApiKind

__all__ = ["configure_parser", "run", "check_target_allowed", "arrival_from_args"]

ARRIVALS = ("constant", "poisson", "gamma", "onoff", "step", "ramp", "surge", "diurnal", "trace")
_DEFAULT_DURATION_S = 30.0
_CLOSED_LOOP_MAX_PLAN = 100_000  # closed loop bounded only by time still needs a finite plan


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.splitlines()[0]
    target = parser.add_argument_group("target")
    target.add_argument("--url", help="base URL, e.g. http://127.0.0.1:8000 (default for --scenario)")
    target.add_argument("--compare", metavar="URL2", help="alternate requests with a second target; report ratios")
    target.add_argument("--allow-remote-host", action="append", default=[], metavar="HOST",
                        help="allow a non-loopback target host (repeatable); loopback only otherwise")
    target.add_argument("--model", default=None,
                        help="model to request (default: the first one the target's /v1/models lists)")
    target.add_argument("--endpoint", choices=[k.value for k in ApiKind], default="chat")
    target.add_argument("--no-stream", dest="stream", action="store_false", help="non-streaming requests")
    target.add_argument("--ignore-eos", action="store_true",
                        help="send vLLM's ignore_eos so every answer runs to max_tokens (engines that know it)")
    target.add_argument("--timeout-s", type=float, default=60.0, help="per-request timeout")

    load = parser.add_argument_group("load")
    load.add_argument("--scenario", choices=["surge"], help="a named scenario (see README)")
    load.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    load.add_argument("--rate", type=float, default=10.0, help="mean requests/s (start rate for ramp)")
    load.add_argument("--requests", type=int, help="stop after this many requests")
    load.add_argument("--duration", type=float, help=f"stop sending after this many seconds "
                                                      f"(default {_DEFAULT_DURATION_S:g} without --requests)")
    load.add_argument("--concurrency", type=int, help="closed loop: this many requests always in flight")
    load.add_argument("--max-inflight", type=int, help="open loop: drop (and count) requests beyond this")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--cv", type=float, default=2.0, help="gamma: coefficient of variation of gaps")
    load.add_argument("--on-s", type=float, default=1.0, help="onoff: burst length")
    load.add_argument("--off-s", type=float, default=1.0, help="onoff: silence length")
    load.add_argument("--step-rates", default="5,10,20", help="step: comma-separated rates")
    load.add_argument("--step-s", type=float, default=10.0, help="step: seconds per rate")
    load.add_argument("--ramp-to", type=float, default=50.0, help="ramp: end rate")
    load.add_argument("--ramp-s", type=float, default=30.0, help="ramp: seconds to reach the end rate")
    load.add_argument("--surge-factor", type=float, default=3.0)
    load.add_argument("--surge-start-s", type=float, default=10.0)
    load.add_argument("--surge-length-s", type=float, default=10.0)
    load.add_argument("--amplitude", type=float, default=0.5, help="diurnal: swing as a fraction of the mean")
    load.add_argument("--period-s", type=float, default=60.0, help="diurnal: one 'day' in seconds")
    load.add_argument("--trace", help="trace CSV, plain or .gz (Azure LLM format); default $TIDEGATE_TRACE, else "
                                      "the Azure conversation trace shipped in the package")
    load.add_argument("--speedup", type=float, default=1.0, help="trace: time compression factor")
    load.add_argument("--rate-scale", type=float, default=1.0, help="trace: thin (<1) or duplicate (>1) requests")

    mix = parser.add_argument_group("traffic mix")
    mix.add_argument("--tenant", action="append", default=[], metavar="NAME:KEY:TIER:SHARE")
    mix.add_argument("--mix-file", help="YAML with `tenants: [{name, key, tier, share}]`")
    mix.add_argument("--prompt-tokens", help="const:N | uniform:LO:HI | lognormal:MEDIAN:SIGMA "
                                             "(default const:128, or the trace's)")
    mix.add_argument("--max-tokens", help="same forms (default const:64, or the trace's)")

    report = parser.add_argument_group("report")
    report.add_argument("--slo-ttft-ms", type=float)
    report.add_argument("--slo-tpot-ms", type=float)
    report.add_argument("--config", help="the target's `tidegate serve` YAML: judge each tier's requests by that "
                                         "tier's TTFT target, as the gateway counts goodput (and as `tidegate sim` "
                                         "does); --slo-* then apply to tiers it does not name")
    report.add_argument("--scrape-metrics", action="store_true", help="scrape the target's /metrics every second")
    report.add_argument("--metric", action="append", default=[], metavar="SUBSTRING",
                        help="metric names to keep when scraping (repeatable; default queue/replica/kv/...)")
    report.add_argument("--lag-warn-ms", type=float, default=10.0, help="warn when p99 send lag exceeds this")
    report.add_argument("--out", help="directory for report.json, records.jsonl and PNG plots")
    report.add_argument("--no-plots", action="store_true")
    report.add_argument("--no-progress", action="store_true")
    report.add_argument("--quiet", action="store_true", help="no table on the terminal")


def check_target_allowed(endpoint: Endpoint, allowed_hosts: list[str]) -> None:
    """Loopback only unless the host is named: a load test aimed at the wrong host is an attack."""
    if endpoint.host in allowed_hosts:
        return
    if endpoint.host == "localhost":
        return
    try:
        if ipaddress.ip_address(endpoint.host).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(f"refusing non-loopback target {endpoint.host!r}; name it with --allow-remote-host {endpoint.host}")


def arrival_from_args(args: argparse.Namespace) -> arrivals.ArrivalProcess:
    kind, rate = args.arrival, args.rate
    if kind == "constant":
        return arrivals.Constant(rate)
    if kind == "poisson":
        return arrivals.Poisson(rate)
    if kind == "gamma":
        return arrivals.GammaBursty(rate, args.cv)
    if kind == "onoff":
        return arrivals.OnOff(rate, args.on_s, args.off_s)
    if kind == "step":
        return arrivals.Step(tuple(float(r) for r in args.step_rates.split(",")), args.step_s)
    if kind == "ramp":
        return arrivals.Ramp(rate, args.ramp_to, args.ramp_s)
    if kind == "surge":
        return arrivals.Surge(rate, args.surge_factor, args.surge_start_s, args.surge_length_s)
    if kind == "diurnal":
        return arrivals.Diurnal(rate, args.amplitude, args.period_s)
    raise ValueError(f"no arrival process {kind!r}")


def _tenants(args: argparse.Namespace, default: tuple[Tenant, ...]) -> tuple[Tenant, ...]:
    tenants = [parse_tenant(spec) for spec in args.tenant]
    if args.mix_file:
        tenants.extend(load_mix_file(args.mix_file))
    return tuple(tenants) or default


@dataclass(frozen=True)
class _PlannedRun:
    plan: list[PlannedRequest]
    load: dict[str, Any]  # a description of the load for the report
    credits: tuple[str, ...] = ()
    phases: tuple[tuple[str, float, float], ...] = ()


def _effective_duration_s(args: argparse.Namespace) -> float | None:
    if args.duration is None and args.requests is None:
        return _DEFAULT_DURATION_S
    return args.duration


def _validate(args: argparse.Namespace) -> None:
    for name in ("rate", "requests", "duration", "concurrency", "max_inflight", "speedup", "rate_scale", "timeout_s"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value:g}")


def _redacted_config(args: argparse.Namespace) -> dict[str, Any]:
    """The command line for the report, without API keys."""
    config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    config["tenant"] = [f"{t.name}:***:{t.tier}:{t.share:g}" for t in map(parse_tenant, args.tenant)]
    return config


def _plan(args: argparse.Namespace, rng: np.random.Generator) -> _PlannedRun:
    duration = _effective_duration_s(args)
    prompt = parse_length(args.prompt_tokens) if args.prompt_tokens else None
    output = parse_length(args.max_tokens) if args.max_tokens else None
    if args.scenario == "surge":
        from tidegate.loadgen.scenarios import SURGE_DEFAULT_TENANTS, SurgeScenario

        scenario = SurgeScenario(duration_s=args.duration or 60.0, factor=args.surge_factor)
        streams = scenario.streams(_tenants(args, SURGE_DEFAULT_TENANTS), prompt or parse_length("const:128"),
                                   output or parse_length("const:64"))
        return _PlannedRun(build_plan(streams, rng, scenario.duration_s, args.requests), {"scenario": repr(scenario)},
                           phases=tuple(scenario.phases()))
    tenants = _tenants(args, (DEFAULT_TENANT,))
    if args.arrival == "trace":
        from tidegate.loadgen.trace import AZURE_TRACE_CREDIT, default_trace_path, load_azure_trace

        path = Path(args.trace) if args.trace else default_trace_path()
        trace = load_azure_trace(path).scaled(rng, speedup=args.speedup, rate_scale=args.rate_scale)
        plan = plan_from_trace(trace, tenants, rng, args.duration, args.requests, prompt, output)
        return _PlannedRun(plan, {"trace": path.name, "speedup": args.speedup, "rate_scale": args.rate_scale},
                           credits=(AZURE_TRACE_CREDIT,))
    process = arrival_from_args(args)
    stream = TrafficStream(process, tenants, prompt or parse_length("const:128"), output or parse_length("const:64"))
    if args.concurrency:
        count = args.requests or _CLOSED_LOOP_MAX_PLAN
        stream = TrafficStream(arrivals.Constant(1.0), tenants, stream.prompt_tokens, stream.max_tokens)
        return _PlannedRun(build_plan([stream], rng, None, count), {"closed_loop_concurrency": args.concurrency})
    return _PlannedRun(build_plan([stream], rng, duration, args.requests), {"arrivals": repr(process)})


def run(args: argparse.Namespace) -> int:
    from tidegate.loadgen.driver import Driver, RunConfig
    from tidegate.loadgen.report import build_report, print_summary, write_report
    from tidegate.loadgen.stats import Slo

    if args.url is None and args.scenario is None:
        print("tidegate bench: --url is required (or --scenario)", file=sys.stderr)
        return 2
    try:
        names = [u for u in [args.url or "http://127.0.0.1:8000", args.compare] if u]
        targets = tuple(parse_url(u) for u in names)
        for endpoint in targets:
            check_target_allowed(endpoint, args.allow_remote_host)
        _validate(args)
        per_tier = _tier_slos(args.config) if args.config else {}
        planned = _plan(args, np.random.default_rng(args.seed))
        if args.model is None:
            args.model = first_listed_model(targets[0], planned.plan)
            print(f"tidegate bench: --model not given; using {args.model!r}, the first the target lists",
                  file=sys.stderr)
    except (ValueError, OSError) as error:
        print(f"tidegate bench: {error}", file=sys.stderr)
        return 2
    config = RunConfig(
        targets=targets, model=args.model, kind=ApiKind(args.endpoint), stream=args.stream,
        ignore_eos=args.ignore_eos,
        timeout_s=args.timeout_s, concurrency=args.concurrency,
        duration_s=_effective_duration_s(args) if args.concurrency else None, max_inflight=args.max_inflight,
        scrape_metrics=args.scrape_metrics,
        **({"metric_patterns": tuple(args.metric)} if args.metric else {}),
    )
    _raise_fd_limit()
    progress = None if args.no_progress or not sys.stdout.isatty() else _progress(len(planned.plan))
    driver = Driver(config, planned.plan, on_progress=progress)
    result = _run_loop(driver.run())
    slo = Slo(ttft_s=args.slo_ttft_ms / 1000 if args.slo_ttft_ms else None,
              tpot_s=args.slo_tpot_ms / 1000 if args.slo_tpot_ms else None)
    report_config = _redacted_config(args)
    report_config["load"] = planned.load
    report = build_report(result, config=report_config, slo=slo, targets=len(targets),
                          lag_threshold_ms=args.lag_warn_ms, credits=planned.credits, open_loop=not args.concurrency,
                          phases=planned.phases, tier_slos=per_tier, target_names=names)
    if not args.quiet:
        print_summary(report)
    if args.out:
        out = Path(args.out)
        path = write_report(report, result, out)
        if not args.no_plots:
            from tidegate.loadgen.plots import write_plots

            write_plots(report, out)
        print(f"report: {path}")
    return 0


def _tier_slos(path: str) -> dict:
    """Each tier's SLO from a serve config (a bad file raises ConfigError, a ValueError)."""
    from tidegate.config import load_config
    from tidegate.loadgen.stats import tier_slos

    return tier_slos(load_config(path).overload.tiers.table())


def _raise_fd_limit() -> None:
    """An open loop opens a connection per concurrent request: the usual soft limit of 1,024
    sockets would turn a surge into 'too many open files' errors in the generator itself."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):  # not on this platform, or not allowed: keep going
        pass


def _run_loop(coroutine):
    try:
        import uvloop

        return uvloop.run(coroutine)
    except ImportError:  # uvloop is a dependency, but the generator still works without it
        import asyncio

        return asyncio.run(coroutine)


def _progress(total: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                   TimeElapsedColumn(), auto_refresh=False)
    task = bar.add_task("bench", total=total, info="")
    bar.start()

    def update(driver) -> None:
        bar.update(task, completed=driver.completed, info=f"sent {driver.sent} in flight {driver.in_flight}")
        bar.refresh()
        if driver.completed >= total:
            bar.stop()

    return update


def first_listed_model(endpoint: Endpoint, plan: list[PlannedRequest]) -> str:
    """The first model of the target's `/v1/models`, asked with the first planned tenant's key if any."""
    import urllib.error
    import urllib.request

    import orjson

    url = f"http://{endpoint.host}:{endpoint.port}{endpoint.base_path}/v1/models"
    key = plan[0].tenant.api_key if plan else None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as response:
            models = orjson.loads(response.read())["data"]
    except (urllib.error.URLError, OSError, KeyError, ValueError) as error:
        raise ValueError(f"cannot list models at {url} ({error}); name one with --model") from None
    if not models:
        raise ValueError(f"{url} lists no models; name one with --model")
    return str(models[0]["id"])
