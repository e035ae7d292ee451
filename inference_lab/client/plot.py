"""``--plot``: concurrency limit, latency and 529 rate against time, as a PNG.

Uses matplotlib's object API (``Figure``) with the Agg renderer: no pyplot global state, no
display needed, safe to call from any thread or test.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from .load import LoadResult
from .report import Summary

__all__ = ["plot_timeseries"]


def plot_timeseries(path: Path, result: LoadResult, summary: Summary) -> None:
    """Write a three-panel figure: limit and in-flight, latency, 529 rate."""
    samples = result.samples
    times = [s.time for s in samples]
    fig = Figure(figsize=(10, 8), layout="constrained")
    ax_limit, ax_lat, ax_rate = fig.subplots(3, 1, sharex=True)

    if result.limit_changes:
        xs = [t for t, _ in result.limit_changes] + [result.end]
        ys = [v for _, v in result.limit_changes]
        ys.append(ys[-1])
        ax_limit.step(xs, ys, where="post", label="limit (AIMD)", color="tab:blue")
    elif any(s.limit is not None for s in samples):
        ax_limit.plot(
            times, [s.limit for s in samples], label="limit", color="tab:blue", drawstyle="steps"
        )
    ax_limit.plot(
        times, [s.in_flight for s in samples], lw=0.8, label="in flight", color="tab:gray"
    )
    a = summary.adaptive
    if a is not None and a.settled_limit is not None:
        ax_limit.axhline(
            a.settled_limit, ls="--", color="tab:green", label=f"settled limit {a.settled_limit}"
        )
        ax_limit.axvspan(result.dispatch_end * 2 / 3, result.dispatch_end, color="0.93")
    ax_limit.set_ylabel("concurrency")
    ax_limit.legend(loc="upper left", fontsize="small")

    e2e = [(s.time, s.e2e_mean * 1000) for s in samples if s.e2e_mean is not None]
    ttft = [(s.time, s.ttft_mean * 1000) for s in samples if s.ttft_mean is not None]
    if e2e:
        ax_lat.plot(*zip(*e2e, strict=True), label="E2E mean", color="tab:orange")
    if ttft:
        ax_lat.plot(*zip(*ttft, strict=True), label="TTFT mean", color="tab:purple")
    ax_lat.set_ylabel("latency (ms, last 1 s)")
    if e2e or ttft:
        ax_lat.legend(loc="upper left", fontsize="small")

    ax_rate.plot(
        times, [100 * s.overload_rate for s in samples], color="tab:red", label="529 share"
    )
    ax_rate.set_ylabel("529 (% of attempts, last 1 s)")
    ax_rate.set_xlabel("time since start (s)")
    ax_rate.set_ylim(bottom=0)

    cfg = result.config
    title = f"{cfg.model} @ {cfg.url} — {cfg.mode}"
    if summary.output_token_throughput is not None:
        title += f" — {summary.output_token_throughput:.0f} output tok/s"
    fig.suptitle(title)
    fig.savefig(path, format="png", dpi=100)
