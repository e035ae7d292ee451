"""``sim --report out.html``: one self-contained HTML file describing a run.

The file holds the run's configuration, the summary table, the sampled time series
(:mod:`inference_lab.sim.series`), latency CDFs and histograms, per-replica panels when
there are several replicas, and the prefix cache when the deployment caches prefixes.

Rule 1: the file loads nothing: the chart library, scripts, styles and data are inline
        (:func:`inference_lab.web.page`), so it opens offline and can be sent as it is.
Rule 2: the data the charts draw is embedded once, as JSON in ``#page-data``; its
        ``summary`` is exactly ``SimResult.to_dict()`` (what ``-o`` writes) and its
        ``config`` exactly ``config_dict``, so the page shows what the JSON holds.
Rule 3: the summary table is written here in HTML, not by the page's script: the numbers
        read without JavaScript.
Rule 4: the embedded distributions are bounded: a CDF is at most :data:`CDF_POINTS`
        quantiles and a histogram :data:`HISTOGRAM_BINS` bins, whatever the run's size.
"""

from __future__ import annotations

import html
from typing import IO, Any

import numpy as np

from inference_lab.sim.records import FinishedTable
from inference_lab.sim.run import SimResult
from inference_lab.sim.summary import LATENCY_COLUMNS, LatencyStats
from inference_lab.sim.text import format_summary
from inference_lab.web import page

__all__ = ["CDF_POINTS", "HISTOGRAM_BINS", "render_report", "report_data"]

#: Quantiles per latency CDF.
CDF_POINTS = 400
#: Bins per latency histogram.
HISTOGRAM_BINS = 40


def _latencies_ms(result: SimResult) -> dict[str, np.ndarray[Any, np.dtype[np.float64]]]:
    fin = result.finished
    if isinstance(fin, FinishedTable):  # the run's compact records: their columns
        arrival = fin.column("arrival_time")
        first = fin.column("first_token_time")
        finish = fin.column("finish_time")
        scheduled = fin.column("first_scheduled_time")
        output = fin.column("output_tokens").astype(np.float64)
    else:
        arrival = np.array([f.arrival_time for f in fin], dtype=np.float64)
        first = np.array([f.first_token_time for f in fin], dtype=np.float64)
        finish = np.array([f.finish_time for f in fin], dtype=np.float64)
        scheduled = np.array([f.first_scheduled_time for f in fin], dtype=np.float64)
        output = np.array([f.output_tokens for f in fin], dtype=np.float64)
    multi = output > 1
    return {
        "ttft": (first - arrival) * 1e3,
        "tpot": (finish[multi] - first[multi]) / (output[multi] - 1) * 1e3,
        "e2e": (finish - arrival) * 1e3,
        "queue": (scheduled - arrival) * 1e3,
    }


def _cdf(values: np.ndarray[Any, np.dtype[np.float64]]) -> dict[str, list[float]]:
    """At most CDF_POINTS (value, cumulative fraction) pairs (Rule 4)."""
    if values.size == 0:
        return {"ms": [], "p": []}
    probs = np.linspace(0.0, 1.0, min(CDF_POINTS, max(2, values.size)))
    qs = np.quantile(values, probs)
    return {"ms": [float(v) for v in qs], "p": [float(p) for p in probs]}


def _histogram(values: np.ndarray[Any, np.dtype[np.float64]]) -> dict[str, list[float]]:
    """HISTOGRAM_BINS equal bins over the values' range: each bin's centre and count."""
    if values.size == 0:
        return {"ms": [], "count": []}
    low, high = float(values.min()), float(values.max())
    if high <= low:
        high = low + 1e-9
    counts, edges = np.histogram(values, bins=HISTOGRAM_BINS, range=(low, high))
    centres = (edges[:-1] + edges[1:]) / 2
    return {"ms": [float(c) for c in centres], "count": [int(c) for c in counts]}


def report_data(result: SimResult, config: dict[str, Any], config_text: str) -> dict[str, Any]:
    """Everything the page draws (Rule 2): the configuration, the summary, the series,
    the latency distributions and the replicas."""
    latencies = _latencies_ms(result)
    series = result.series
    return {
        "config": config,
        "config_text": config_text,
        "summary": result.to_dict(),
        "summary_text": format_summary(result),
        "show_prefix_cache": _shows_prefix_cache(result),
        "series": None
        if series is None
        else {
            "interval_s": series.interval,
            "replicas": series.replicas,
            "columns": series.columns(),
        },
        "cdf": {name: _cdf(values) for name, values in latencies.items()},
        "histograms": {name: _histogram(values) for name, values in latencies.items()},
    }


def _shows_prefix_cache(result: SimResult) -> bool:
    """As the printed summary: the cache is reported when it is on and the workload's
    requests carry content (it can hit), or it hit."""
    pc = result.prefix_cache
    return pc is not None and pc.enabled and (result.has_content or pc.hit_tokens > 0)


def _cell(value: float | None) -> str:
    return "–" if value is None else f"{value:,.3f}"


def _summary_html(result: SimResult) -> str:
    """The summary as HTML tables and a list of facts (Rule 3)."""
    s = result.summary
    rows: list[tuple[str, LatencyStats]] = [
        ("TTFT", s.ttft),
        ("TPOT", s.tpot),
        ("E2E", s.e2e),
        ("queue", s.queue),
    ]
    head = "".join(f"<th>{c}</th>" for c in (*LATENCY_COLUMNS, "n"))
    body = []
    for name, stats in rows:
        cells = "".join(
            f'<td data-key="{name.lower()}.{c}">{_cell(getattr(stats, c))}</td>'
            for c in LATENCY_COLUMNS
        )
        body.append(
            f"<tr><th>{name}</th>{cells}"
            f'<td data-key="{name.lower()}.count">{stats.count:,}</td></tr>'
        )
    table = (
        '<table class="summary" id="latency-table"><thead><tr><th>latency (ms)</th>'
        f"{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
    )
    facts: list[tuple[str, str]] = [
        (
            "requests",
            f"{s.requests_completed:,} completed, {s.requests_refused:,} refused",
        ),
        (
            "throughput",
            f"{s.input_tokens_per_s:,.1f} input tok/s, {s.output_tokens_per_s:,.1f} output "
            f"tok/s, {s.requests_per_s:,.3f} req/s over {s.span_s:,.3f} s",
        ),
        (
            "utilisation",
            f"KV cache {s.kv_usage_mean:.1%} mean ({s.kv_usage_max:.1%} peak), FLOP "
            f"{s.flop_util_mean:.1%}, HBM bandwidth {s.bw_util_mean:.1%} "
            f"(means over {s.steps:,} steps)",
        ),
        ("preemptions", f"{s.preemptions:,}; peak waiting queue {result.peak_waiting:,}"),
    ]
    pc = result.prefix_cache
    if _shows_prefix_cache(result) and pc is not None:
        facts.append(
            (
                "prefix cache",
                f"{pc.hit_rate:.1%} of {pc.query_tokens:,} prompt tokens cached "
                f"({pc.hit_tokens:,} prefill tokens saved); {pc.requests_hit:,} of "
                f"{pc.requests:,} requests hit",
            )
        )
    if result.capacity is not None and result.capacity.message() is not None:
        facts.append(("capacity", str(result.capacity.message())))
    facts.append(
        ("time", f"{result.sim_time_s:,.3f} s simulated in {result.wall_time_s:,.3f} s real")
    )
    dl = "".join(
        f'<dt>{html.escape(k)}</dt><dd data-key="{html.escape(k)}">{html.escape(v)}</dd>'
        for k, v in facts
    )
    out = table + f'<dl class="facts" id="facts">{dl}</dl>'
    if len(result.replicas) > 1:
        rows_html = "".join(
            f"<tr><td>{r.replica}</td><td>{r.requests:,}</td><td>{r.query_tokens:,}</td>"
            f"<td>{r.hit_tokens:,}</td><td>{r.hit_rate:.1%}</td></tr>"
            for r in result.replicas
        )
        out += (
            '<h2>Replicas</h2><table class="summary" id="replica-table"><thead><tr>'
            "<th>replica</th><th>requests</th><th>prompt tokens looked up</th>"
            "<th>cached</th><th>hit rate</th></tr></thead>"
            f"<tbody>{rows_html}</tbody></table>"
        )
    return out


def render_report(result: SimResult, config: dict[str, Any], config_text: str) -> str:
    """The report's HTML (module rules)."""
    data = report_data(result, config, config_text)
    title = f"{config.get('model', 'model')} on {config.get('hardware', '')}: sim report"
    body = (
        f'<h2>Configuration</h2><pre class="config">{html.escape(config_text)}</pre>'
        f"<h2>Summary</h2>{_summary_html(result)}"
    )
    return page(
        "report.html",
        scripts=("uPlot.iife.min.js", "charts.js", "report.js"),
        styles=("uPlot.min.css", "pages.css"),
        title=title,
        body=body,
        data=data,
    ).html


def write_report(result: SimResult, config: dict[str, Any], config_text: str, out: IO[str]) -> None:
    """Write the report to ``out``."""
    out.write(render_report(result, config, config_text))
