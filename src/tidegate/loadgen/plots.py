"""PNG plots of bench reports, live or simulated, on one shared timeline.

Each plot draws one or more *arms*: a target of a report (a URL, or a simulated arm such as
"FIFO"), so `tidegate report compare` overlays a live run and a simulated run with the same code.
Panels: TTFT percentiles per tier against each tier's target; offered, served and refused load;
replica utilisation (or requests on each replica) with the dispatcher's queue on a second axis;
and, for an autoscaled pool, replicas ready and desired.
matplotlib is imported here only, and only when plotting.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Arm", "arms_of", "write_plots", "write_timeline"]

_ARM_STYLES = ("-", ":", "--", "-.")
_TIER_COLORS = ("tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:brown", "tab:pink")
_MAX_REPLICA_LINES = 8  # more replicas are drawn as their mean with a min-max band


@dataclass(frozen=True)
class Arm:
    label: str
    timeline: list[dict[str, Any]]  # per-second buckets (`stats.timeline`)
    metrics: list[dict[str, Any]] = field(default_factory=list)  # scraped samples of this target
    tier_targets_ms: dict[str, float | None] = field(default_factory=dict)  # in rank order


def arms_of(report: dict[str, Any], prefix: str = "") -> list[Arm]:
    """One arm per target of a report; `prefix` tells two reports' arms apart in a comparison."""
    names = report.get("targets") or [f"target {t}" for t in range(len(report["timeline"]))]
    tiers = {tier["name"]: tier.get("ttft_target_ms") for tier in report.get("tiers", [])}
    return [Arm(f"{prefix}{names[t]}", buckets, [m for m in report["metrics"] if m["target"] == t], tiers)
            for t, buckets in enumerate(report["timeline"])]


def _tier_lines(buckets: list[dict[str, Any]]) -> dict[str, list[tuple[float, float, float]]]:
    """tier -> [(t_s, p50_ms, p99_ms)]; reports without per-tier buckets give one line, "all"."""
    lines: dict[str, list[tuple[float, float, float]]] = {}
    for bucket in buckets:
        by_tier = bucket.get("ttft_by_tier")
        if by_tier is None and bucket["ttft_p50_ms"] is not None:
            by_tier = {"all": [bucket["ttft_p50_ms"], bucket["ttft_p99_ms"]]}
        for tier, (p50, p99) in (by_tier or {}).items():
            lines.setdefault(tier, []).append((bucket["t_s"], p50, p99))
    return lines


def _latency_panel(ax, arms: Sequence[Arm]) -> None:
    ranked = list(dict.fromkeys(tier for arm in arms for tier in arm.tier_targets_ms))
    seen = sorted({tier for arm in arms for tier in _tier_lines(arm.timeline)} - set(ranked))
    colors = {tier: _TIER_COLORS[i % len(_TIER_COLORS)] for i, tier in enumerate(ranked + seen)}
    for style, arm in zip(_ARM_STYLES * 4, arms):
        prefix = f"{arm.label}: " if len(arms) > 1 else ""
        for tier, points in _tier_lines(arm.timeline).items():
            t = [p[0] for p in points]
            ax.plot(t, [p[2] for p in points], linestyle=style, color=colors[tier], label=f"{prefix}{tier} p99")
            ax.plot(t, [p[1] for p in points], linestyle=style, color=colors[tier], alpha=0.4, linewidth=0.8,
                    label=f"{prefix}{tier} p50")
    drawn = {tier for arm in arms for tier in _tier_lines(arm.timeline)}
    targets = {tier: ms for arm in arms for tier, ms in arm.tier_targets_ms.items() if ms is not None and tier in drawn}
    for tier, target_ms in targets.items():  # a wide pale band: a reference, not a series
        ax.axhline(target_ms, color=colors[tier], linewidth=5, alpha=0.2, label=f"{tier} target {target_ms:g} ms")
    if ax.lines:
        ax.set_yscale("log")  # a tier within target and one 100x over it, on one axis
    ax.set(ylabel="TTFT ms (log)", title="Time to first token per tier, by send time, against each tier's target")
    ax.legend(fontsize="x-small", ncol=2)


def _load_panel(ax, arms: Sequence[Arm]) -> None:
    kinds = (("sent", "offered", "tab:gray"), ("completed", "served", "tab:green"),
             ("rejected", "refused (429/503)", "tab:red"), ("errors", "other errors", "black"))
    for style, arm in zip(_ARM_STYLES * 4, arms):
        prefix = f"{arm.label}: " if len(arms) > 1 else ""
        t = [b["t_s"] for b in arm.timeline]
        for key, name, color in kinds:
            values = [b[key] for b in arm.timeline]
            if any(values):
                ax.plot(t, values, linestyle=style, color=color, label=f"{prefix}{name}")
    ax.set(ylabel="requests per second", title="Offered, served and refused load")
    ax.legend(fontsize="x-small", ncol=2)


def _series_name(series: str) -> str:
    return series.split("{", 1)[0]


def _label(series: str, key: str) -> str:
    """The value of one label of an exposed series, `name{key="value",...}`."""
    match = re.search(key + r'="([^"]*)"', series)
    return match.group(1) if match else series


def _replica_series(metrics: list[dict[str, Any]]) -> tuple[str, dict[str, list[tuple[float, float]]]]:
    """What the replicas did, per replica: busy fraction where known, else requests on each."""
    for name, unit in (("busy_ratio", "busy fraction"), ("replica_outstanding", "requests on the replica"),
                       ("running_sequences", "running sequences")):
        series: dict[str, list[tuple[float, float]]] = {}
        for sample in metrics:
            if name in _series_name(sample["series"]) and "replica=" in sample["series"]:
                series.setdefault(sample["series"], []).append((sample["t_s"], sample["value"]))
        if series:
            return unit, series
    return "", {}


def _queue_series(metrics: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """The dispatcher's queue depth summed over its labels (pools, tiers)."""
    for name in ("tidegate_queue_depth", "tidegate_overload_queue_depth"):
        totals: dict[float, float] = {}
        for sample in metrics:
            if _series_name(sample["series"]) == name:
                totals[sample["t_s"]] = totals.get(sample["t_s"], 0.0) + sample["value"]
        if totals:
            return sorted(totals.items())
    return []


def _replica_panel(ax, arms: Sequence[Arm]) -> bool:
    """False when no arm has replica or queue samples (nothing drawn)."""
    drew = False
    queue_ax = None
    for style, arm in zip(_ARM_STYLES * 4, arms):
        prefix = f"{arm.label}: " if len(arms) > 1 else ""
        unit, series = _replica_series(arm.metrics)
        if len(series) > _MAX_REPLICA_LINES:
            times = sorted({t for points in series.values() for t, _ in points})
            by_time: dict[float, list[float]] = {t: [] for t in times}
            for points in series.values():
                for t, value in points:
                    by_time[t].append(value)
            ax.fill_between(times, [min(by_time[t]) for t in times], [max(by_time[t]) for t in times],
                            alpha=0.2, color="tab:blue")
            ax.plot(times, [sum(by_time[t]) / len(by_time[t]) for t in times], linestyle=style, color="tab:blue",
                    label=f"{prefix}{unit}, mean of {len(series)} replicas (band: min-max)")
        else:
            for name, points in sorted(series.items()):
                ax.plot([p[0] for p in points], [p[1] for p in points], linestyle=style,
                        label=f"{prefix}{_label(name, 'replica')}")
        if unit:
            ax.set_ylabel(unit)
            if unit == "busy fraction":
                ax.set_ylim(0.0, 1.05)
            drew = True
        queue = _queue_series(arm.metrics)
        if queue:
            queue_ax = queue_ax or ax.twinx()
            queue_ax.plot([q[0] for q in queue], [q[1] for q in queue], linestyle=style, color="black",
                          linewidth=0.8, label=f"{prefix}queued")
            queue_ax.set_ylabel("requests queued")
            queue_ax.legend(fontsize="x-small", loc="upper right")
            drew = True
    ax.set(title="Replicas and the queue")
    if ax.lines:
        ax.legend(fontsize="x-small", loc="upper left")
    return drew


def _fleet_series(metrics: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Replicas ready and desired (an autoscaled pool), summed over pools."""
    fleet: dict[str, dict[float, float]] = {}
    for sample in metrics:
        name = _series_name(sample["series"])
        if name in ("tidegate_replicas_ready", "tidegate_desired_replicas"):
            by_time = fleet.setdefault(name.removeprefix("tidegate_"), {})
            by_time[sample["t_s"]] = by_time.get(sample["t_s"], 0.0) + sample["value"]
    return {name: sorted(points.items()) for name, points in fleet.items()}


def _fleet_panel(ax, arms: Sequence[Arm]) -> bool:
    drew = False
    for style, arm in zip(_ARM_STYLES * 4, arms):
        prefix = f"{arm.label}: " if len(arms) > 1 else ""
        for name, points in sorted(_fleet_series(arm.metrics).items()):
            ax.step([p[0] for p in points], [p[1] for p in points], where="post", linestyle=style,
                    color="tab:blue" if name == "replicas_ready" else "tab:orange",
                    label=f"{prefix}{name.replace('_', ' ')}")
            drew = True
    ax.set(ylabel="replicas", title="Replicas: ready and desired (the autoscaler)")
    if drew:
        ax.legend(fontsize="x-small")
    return drew


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def write_timeline(arms: Sequence[Arm], path: Path, title: str = "") -> Path:
    """Every panel stacked on one shared time axis."""
    plt = _pyplot()
    panels = [_latency_panel, _load_panel]
    if any(_replica_series(a.metrics)[1] or _queue_series(a.metrics) for a in arms):
        panels.append(_replica_panel)
    if any(_fleet_series(a.metrics) for a in arms):
        panels.append(_fleet_panel)
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.75 * len(panels)), sharex=True)
    for ax, panel in zip(axes, panels):
        panel(ax, arms)
    axes[-1].set_xlabel("time since start (s)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """latency.png, load.png, replicas.png (when there are replica or queue samples), fleet.png
    (when the pool was autoscaled) and timeline.png (all of them on one time axis)."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    arms = arms_of(report)
    written: list[Path] = []
    for name, panel in (("latency.png", _latency_panel), ("load.png", _load_panel), ("replicas.png", _replica_panel),
                        ("fleet.png", _fleet_panel)):
        fig, ax = plt.subplots(figsize=(11, 4.5))
        drew = panel(ax, arms)
        ax.set_xlabel("time since start (s)")
        if drew is False:
            plt.close(fig)
            continue
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        written.append(out_dir / name)
    written.append(write_timeline(arms, out_dir / "timeline.png"))
    return written
