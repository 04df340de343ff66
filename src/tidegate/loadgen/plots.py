"""PNG plots of a bench report. matplotlib is imported here only, and only when plotting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["write_plots"]


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig, name: str) -> None:
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    series = report["timeline"]
    fig, ax = plt.subplots(figsize=(9, 4))
    for target, buckets in enumerate(series):
        t = [b["t_s"] for b in buckets]
        ax.plot(t, [b["ttft_p50_ms"] for b in buckets], label=f"target {target} TTFT p50")
        ax.plot(t, [b["ttft_p99_ms"] for b in buckets], label=f"target {target} TTFT p99", linestyle="--")
    ax.set(xlabel="time since start (s, by send time)", ylabel="ms", title="TTFT percentiles over time")
    ax.legend()
    save(fig, "latency.png")

    fig, ax = plt.subplots(figsize=(9, 4))
    for target, buckets in enumerate(series):
        t = [b["t_s"] for b in buckets]
        ax.plot(t, [b["sent"] for b in buckets], label=f"target {target} sent/s")
        ax.plot(t, [b["completed"] for b in buckets], label=f"target {target} completed/s")
    ax.set(xlabel="time since start (s)", ylabel="requests per second", title="Throughput")
    ax.legend()
    save(fig, "throughput.png")

    fig, ax = plt.subplots(figsize=(9, 4))
    for target, buckets in enumerate(series):
        t = [b["t_s"] for b in buckets]
        ax.plot(t, [b["rejected"] for b in buckets], label=f"target {target} 429/503 per s")
        ax.plot(t, [b["degraded"] for b in buckets], label=f"target {target} degraded per s")
        ax.plot(t, [b["errors"] for b in buckets], label=f"target {target} other errors per s")
    ax.set(xlabel="time since start (s, by send time)", ylabel="count per second", title="Rejections")
    ax.legend()
    save(fig, "rejections.png")

    if report["metrics"]:
        fig, ax = plt.subplots(figsize=(9, 4))
        by_series: dict[str, list[tuple[float, float]]] = {}
        for sample in report["metrics"]:
            by_series.setdefault(f"{sample['target']}:{sample['series']}", []).append((sample["t_s"], sample["value"]))
        for name, points in sorted(by_series.items())[:12]:  # a legend of more is unreadable
            ax.plot([p[0] for p in points], [p[1] for p in points], label=name)
        ax.set(xlabel="time since start (s)", ylabel="value", title="Scraped gauges (queue depth, replicas, KV use)")
        ax.legend(fontsize="x-small")
        save(fig, "queue.png")
    return written
