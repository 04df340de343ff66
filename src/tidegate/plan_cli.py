"""`tidegate plan`: replicas per window of a trace (or a forecast's rates), by the seeds' formula and then verified and refined
in the simulator against an SLO; replica-hours (and money) against provisioning for 2x the peak."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tidegate.plan import Plan, forecast_requests, plan_capacity, read_forecast
from tidegate.sim_cli import _mix
from tidegate.simulate import DEFAULT_PROFILE, trace_requests

__all__ = ["configure_parser", "run", "format_plan"]


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", help="an Azure-format trace (default: the shipped conversation trace); with "
                        "--forecast, where request lengths are drawn from")
    parser.add_argument("--forecast", help="plan for a forecast instead of the trace: a CSV with columns "
                        "start_s,rate_rps (each rate holds until the next row); one window per row unless --windows")
    parser.add_argument("--speedup", type=float, default=1.0, help="replay the trace this much faster (the plan's "
                        "hours are the trace's own)")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="the traffic to plan for, as a multiple of "
                        "the trace's (e.g. 2 for next year's growth)")
    parser.add_argument("--duration-s", type=float, help="plan for the trace's first DURATION seconds (replayed)")
    parser.add_argument("--mix", default="", help="tiers by share, e.g. critical:0.2,standard:0.8")
    parser.add_argument("--config", help="a `tidegate serve` YAML: tiers and their TTFT targets, slot limits")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help="shipped profile name or profile file")
    parser.add_argument("--slo", type=float, default=0.99, help="share of requests within their tier's TTFT target")
    parser.add_argument("--windows", type=int, help="windows the trace is planned in (default 12; with "
                        "--forecast, one per row)")
    parser.add_argument("--target-utilisation", type=float, default=0.8, help="the formula's utilisation target")
    parser.add_argument("--max-replicas", type=int, default=64)
    parser.add_argument("--price", type=float, help="price of a replica-hour, for the cost line")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="directory for plan.json and plan.png")


def format_plan(plan: Plan, speedup: float) -> str:
    lines = [f"{'window':>8} {'req/s':>7} {'formula':>7} {'planned':>7} {'within target':>13}  simulated (replicas: share)"]
    for window in plan.windows:
        start_min = window.start_s * speedup / 60.0
        tried = " ".join(f"{n}:{share:.3f}" for n, share in sorted(window.tried))
        lines.append(f"{start_min:6.0f}'m {window.rate_rps / speedup:7.2f} {window.formula:7d} {window.replicas:7d} "
                     f"{window.attainment:13.1%}  {tried}")
    lines.append(f"plan: {plan.replica_hours:.2f} replica-hours, {plan.attainment:.2%} of requests within target "
                 f"(SLO {plan.slo:.1%}); 2x the peak: {plan.static_replicas} replicas all the time, "
                 f"{plan.static_replica_hours:.2f} replica-hours ({plan.static_replica_hours / plan.replica_hours:.2f}x)")
    if plan.price_per_replica_hour is not None:
        lines.append(f"cost: {plan.replica_hours * plan.price_per_replica_hour:,.2f} against "
                     f"{plan.static_replica_hours * plan.price_per_replica_hour:,.2f} for 2x the peak")
    return "\n".join(lines)


def _plot(plan: Plan, speedup: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [w.start_s * speedup / 60.0 for w in plan.windows]
    width = plan.window_s * speedup / 60.0
    figure, axis = plt.subplots(figsize=(9, 4))
    axis.bar(minutes, [w.replicas for w in plan.windows], width=width * 0.9, align="edge", label="planned (simulated)")
    axis.step(minutes + [minutes[-1] + width], [w.formula for w in plan.windows] + [plan.windows[-1].formula],
              where="post", color="black", label="the seeds' formula")
    axis.axhline(plan.static_replicas, color="grey", linestyle="--", label="2x the peak")
    axis.set_xlabel("minutes into the trace")
    axis.set_ylabel("replicas")
    axis.set_title(f"capacity plan: {plan.attainment:.1%} within target (SLO {plan.slo:.0%}), "
                   f"{plan.replica_hours:.1f} replica-hours")
    axis.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def run(args: argparse.Namespace) -> int:
    try:
        mix = _mix(args.mix)
        requests = trace_requests(args.trace, speedup=args.speedup, rate_scale=args.rate_scale,
                                  duration_s=args.duration_s, mix=mix or None, seed=args.seed)
        windows = args.windows or 12
        if args.forecast:
            rows = read_forecast(args.forecast)
            requests = forecast_requests(rows, requests, seed=args.seed)
            windows = args.windows or len(rows)
        plan = plan_capacity(requests, config=args.config, profile=args.profile, windows=windows, slo=args.slo,
                             target_utilisation=args.target_utilisation, max_replicas=args.max_replicas,
                             speedup=args.speedup, price_per_replica_hour=args.price)
    except (ValueError, OSError) as error:
        print(f"tidegate plan: {error}", file=sys.stderr)
        return 2
    print(format_plan(plan, args.speedup))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(json.dumps(plan.as_dict(), indent=2))
        _plot(plan, args.speedup, out / "plan.png")
        print(f"wrote {out / 'plan.json'} and {out / 'plan.png'}")
    missed = [w for w in plan.windows if w.attainment < plan.slo]
    if missed:
        print(f"{len(missed)} window(s) miss the SLO even at --max-replicas {args.max_replicas}", file=sys.stderr)
        return 1
    return 0
