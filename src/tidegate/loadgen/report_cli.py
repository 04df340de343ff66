"""`tidegate report`: read bench reports again, alone or side by side.

    tidegate report show out/report.json [--out plots/]
    tidegate report compare live/report.json sim/report.json [--out compare/]

Both work on any report of schema "tidegate.bench.report/1": one written by `tidegate bench` (a
live run) or by `tidegate sim run --out` (a simulated one), so a live run and a simulation of the
same scenario compare line by line: per tier, the figures of A and B and their ratio B / A; and
one timeline plot (`compare.png`) with both on a shared time axis.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import orjson

from tidegate.loadgen.report import SCHEMA

__all__ = ["configure_parser", "run", "load_report", "compare_rows"]

# (label, path into a group summary); a ratio B / A is printed for each
_COMPARED = (
    ("requests", "requests"), ("served", "succeeded"), ("refused", "refused"), ("TTFT p50 ms", "ttft.p50_ms"),
    ("TTFT p99 ms", "ttft.p99_ms"), ("E2E p50 ms", "e2e.p50_ms"), ("E2E p99 ms", "e2e.p99_ms"),
    ("served/s", "throughput_rps"), ("goodput/s", "goodput_rps"),
)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="report_command", metavar="SUBCOMMAND", required=True)
    show = sub.add_parser("show", help="print a report's tables and draw its plots again")
    show.add_argument("report", help="a report.json")
    show.add_argument("--out", help="directory for the plots (default: none drawn)")
    compare = sub.add_parser("compare", help="two reports side by side: per tier A, B and B / A; one timeline")
    compare.add_argument("a", help="report.json A (e.g. a live run)")
    compare.add_argument("b", help="report.json B (e.g. the simulated run)")
    compare.add_argument("--target-a", type=int, default=0, help="which target of A (a report may hold two)")
    compare.add_argument("--target-b", type=int, default=0, help="which target of B")
    compare.add_argument("--label-a", help="A's name in the table and plot (default: its target's name)")
    compare.add_argument("--label-b", help="B's name")
    compare.add_argument("--out", help="directory for compare.png and compare.json")


def load_report(path: str | Path) -> dict[str, Any]:
    """A report, checked to be one this version reads."""
    try:
        report = orjson.loads(Path(path).read_bytes())
    except orjson.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error})") from None
    if not isinstance(report, dict) or report.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a report of schema {SCHEMA!r}")
    return report


def _value(summary: dict[str, Any] | None, path: str) -> float | None:
    if summary is None:
        return None
    if path == "refused":
        return float(summary["statuses"].get("429", 0) + summary["statuses"].get("503", 0))
    value: Any = summary
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return None if value is None else float(value)


def _groups(report: dict[str, Any], target: int) -> dict[str, dict[str, Any]]:
    groups = {s["tier"]: s for s in report["summaries"] if s["target"] == target}
    if not groups:
        raise ValueError(f"the report has no target {target}")
    return groups


def compare_rows(a: dict[str, Any], b: dict[str, Any], target_a: int = 0, target_b: int = 0
                 ) -> list[dict[str, Any]]:
    """Per tier ("all" first, then tiers in A's order, then B's others) and figure: A, B, B / A."""
    groups_a, groups_b = _groups(a, target_a), _groups(b, target_b)
    tiers = ["all"] + [t for t in groups_a if t != "all"] + [t for t in groups_b if t not in groups_a]
    rows = []
    for tier in tiers:
        for label, path in _COMPARED:
            value_a, value_b = _value(groups_a.get(tier), path), _value(groups_b.get(tier), path)
            ratio = value_b / value_a if value_a and value_b is not None else None
            rows.append({"tier": tier, "figure": label, "a": value_a, "b": value_b, "ratio": ratio})
    return rows


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 100 or float(value).is_integer() else f"{value:.3g}"


def _compare(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from tidegate.loadgen.plots import arms_of, write_timeline

    a, b = load_report(args.a), load_report(args.b)
    rows = compare_rows(a, b, args.target_a, args.target_b)
    arm_a, arm_b = arms_of(a)[args.target_a], arms_of(b)[args.target_b]
    label_a = args.label_a or arm_a.label
    label_b = args.label_b or arm_b.label
    if label_a == label_b:
        label_a, label_b = f"A {label_a}", f"B {label_b}"
    table = Table(title=f"A = {label_a} ({args.a}), B = {label_b} ({args.b})")
    for column in ("tier", "figure", "A", "B", "B / A"):
        table.add_column(column, justify="right")
    for row in rows:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
        table.add_row(row["tier"], row["figure"], _fmt(row["a"]), _fmt(row["b"]), ratio)
    Console(width=None if sys.stdout.isatty() else 120).print(table)
    if args.out:
        from dataclasses import replace

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.json").write_bytes(orjson.dumps({"a": str(args.a), "b": str(args.b), "label_a": label_a,
                                                         "label_b": label_b, "rows": rows},
                                                        option=orjson.OPT_INDENT_2))
        path = write_timeline([replace(arm_a, label=label_a), replace(arm_b, label=label_b)], out / "compare.png",
                              title=f"{label_a} (solid) vs {label_b} (dotted)")
        print(f"wrote {path} and {out / 'compare.json'}")
    return 0


def _show(args: argparse.Namespace) -> int:
    from tidegate.loadgen.report import print_summary

    report = load_report(args.report)
    print_summary(report)
    if args.out:
        from tidegate.loadgen.plots import write_plots

        for path in write_plots(report, Path(args.out)):
            print(f"wrote {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        return _compare(args) if args.report_command == "compare" else _show(args)
    except (ValueError, OSError) as error:
        print(f"tidegate report: {error}", file=sys.stderr)
        return 2
