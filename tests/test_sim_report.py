"""``sim --timeseries`` and ``sim --report`` (:mod:`inference_lab.sim.series`,
:mod:`inference_lab.sim.report`): the sampled series agrees with the run it samples and
stays one point per interval, and the report embeds exactly the summary and configuration
``-o`` writes, with its table readable without JavaScript."""

from __future__ import annotations

import csv
import json
import math
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from inference_lab import cli
from inference_lab.core.config import load_deployment, load_workload
from inference_lab.sim.report import CDF_POINTS, render_report
from inference_lab.sim.run import SimResult, run_simulation
from inference_lab.sim.text import config_dict, format_config

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
GPT_OSS = CONFIGS / "gpt-oss-20b.toml"
LLAMA = CONFIGS / "Llama-3.1-8B-Instruct.toml"
QUICK = CONFIGS / "workloads" / "quick.toml"
SESSIONS = """
arrival_pattern = "poisson"
arrival_rate = 4.0
input_len_dist = { type = "fixed", value = 100 }
output_len_dist = { type = "fixed", value = 50 }
seed = 3

[sessions]
num_sessions = 12
turns = { type = "fixed", value = 4 }
think_time = { type = "fixed", value = 1.0 }
system_prompt_tokens = 1024
"""


def quick_run(interval: float = 0.25, **scheduler: Any) -> SimResult:
    dep = load_deployment(GPT_OSS, "b200")
    if scheduler:
        dep = attrs.evolve(dep, scheduler=attrs.evolve(dep.scheduler, **scheduler))
    return run_simulation(dep, load_workload(QUICK), series_interval=interval)


def test_the_series_adds_up_to_the_run() -> None:
    """Per-interval counts sum to the run's totals; one point per interval up to the
    end; each interval's TTFT percentiles are those of the requests finishing in it."""
    result = quick_run()
    series = result.series
    assert series is not None and series.interval == 0.25
    points = series.points
    assert len(points) == math.ceil(result.sim_time_s / 0.25)
    assert points[0].t_start == 0.0 and points[-1].t_end == pytest.approx(result.sim_time_s)
    for a, b in zip(points, points[1:], strict=False):
        assert b.t_start == pytest.approx(a.t_end)
    s = result.summary
    assert sum(p.finished for p in points) == s.requests_completed
    assert sum(p.arrivals for p in points) == s.requests_submitted
    assert sum(p.output_tokens for p in points) == s.output_tokens
    assert sum(p.steps for p in points) == s.steps
    assert sum(p.preemptions for p in points) == s.preemptions
    assert points[-1].running == 0 and points[-1].waiting == 0
    assert max(p.running for p in points) > 0
    for p in points:
        ttfts = [
            (f.first_token_time - f.arrival_time) * 1e3
            for f in result.finished
            if p.t_start <= f.finish_time < p.t_end
            or (p is points[-1] and f.finish_time == p.t_end)
        ]
        if ttfts:
            assert p.ttft_p50_ms == pytest.approx(float(np.percentile(ttfts, 50)))
            assert p.ttft_p99_ms == pytest.approx(float(np.percentile(ttfts, 99)))
        else:
            assert p.ttft_p50_ms is None


def test_the_series_is_one_point_per_interval_not_per_step() -> None:
    """Rule 1: the point count follows the interval, not the steps."""
    fine, coarse = quick_run(0.1), quick_run(1.0)
    assert fine.series is not None and coarse.series is not None
    assert len(coarse.series.points) == math.ceil(coarse.sim_time_s)
    assert len(fine.series.points) == math.ceil(fine.sim_time_s / 0.1 - 1e-9)
    assert fine.summary.steps > 10 * len(fine.series.points)
    assert fine.summary == coarse.summary


def test_without_a_series_interval_nothing_is_sampled() -> None:
    dep = load_deployment(GPT_OSS, "b200")
    assert run_simulation(dep, load_workload(QUICK)).series is None


def test_refusals_by_max_waiting_are_in_the_series(tmp_path: Path) -> None:
    """A burst of 20 on 2 seats and 1 waiting place: 17 refusals, all in the first
    interval, counted among its arrivals."""
    wl = tmp_path / "burst.toml"
    wl.write_text(
        'arrival_pattern = "batched"\nnum_requests = 20\n'
        'input_len_dist = { type = "fixed", value = 100 }\n'
        'output_len_dist = { type = "fixed", value = 50 }\nseed = 1\n'
    )
    dep = load_deployment(GPT_OSS, "b200")
    dep = attrs.evolve(dep, scheduler=attrs.evolve(dep.scheduler, max_num_seqs=2, max_waiting=1))
    result = run_simulation(dep, load_workload(wl), series_interval=0.5)
    assert result.series is not None
    first = result.series.points[0]
    assert first.refused == 17 and first.arrivals == 20
    assert sum(p.refused for p in result.series.points) == 17


def test_replicas_and_the_prefix_cache_are_sampled_per_replica(tmp_path: Path) -> None:
    wl = tmp_path / "s.toml"
    wl.write_text(SESSIONS)
    dep = load_deployment(LLAMA, "h100")
    dep = attrs.evolve(dep, hardware=attrs.evolve(dep.hardware, replicas=2))
    result = run_simulation(dep, load_workload(wl), series_interval=1.0)
    series = result.series
    assert series is not None and series.replicas == 2
    assert all(len(p.replicas) == 2 for p in series.points)
    pc = result.prefix_cache
    assert pc is not None and pc.hit_tokens > 0
    assert sum(p.prefix_hits for p in series.points) == pc.hit_tokens
    assert sum(p.prefix_queries for p in series.points) == pc.query_tokens
    for i, replica in enumerate(result.replicas):
        assert sum(p.replicas[i].prefix_hits for p in series.points) == replica.hit_tokens
    cols = series.columns()
    assert "r1_kv_usage" in cols and len(cols["r1_kv_usage"]) == len(series.points)


class _Page(HTMLParser):
    """The embedded JSON, the summary table's cells by data-key, and every URL."""

    def __init__(self) -> None:
        super().__init__()
        self.data_json = ""
        self.cells: dict[str, str] = {}
        self.urls: list[str] = []
        self._in: str | None = None

    def handle_starttag(self, tag: str, attrs_: list[tuple[str, str | None]]) -> None:
        a = dict(attrs_)
        for key in ("src", "href"):
            if a.get(key):
                self.urls.append(str(a[key]))
        if tag == "script" and a.get("id") == "page-data":
            self._in = "json"
        elif a.get("data-key"):
            self._in = str(a["data-key"])
            self.cells[self._in] = ""

    def handle_endtag(self, tag: str) -> None:
        self._in = None

    def handle_data(self, data: str) -> None:
        if self._in == "json":
            self.data_json += data
        elif self._in is not None:
            self.cells[self._in] += data


def _report(result: SimResult, workload: Path) -> tuple[str, dict[str, Any], _Page]:
    dep = load_deployment(GPT_OSS, "b200")
    wl = load_workload(workload)
    config = config_dict(dep, wl, str(workload), wl.seed)
    html = render_report(result, config, format_config(dep, wl, str(workload), wl.seed))
    parsed = _Page()
    parsed.feed(html)
    return html, config, parsed


def test_the_report_embeds_exactly_the_summary_and_the_configuration() -> None:
    """Rule 2: the embedded data's summary is ``to_dict()`` (what -o writes), its config
    ``config_dict``; the series and bounded CDFs are there; the page loads nothing."""
    result = quick_run()
    html, config, page = _report(result, QUICK)
    data = json.loads(page.data_json)
    assert data["summary"] == json.loads(json.dumps(result.to_dict()))
    assert data["config"] == json.loads(json.dumps(config))
    assert result.series is not None
    assert data["series"]["columns"] == json.loads(json.dumps(result.series.columns()))
    for name in ("ttft", "tpot", "e2e", "queue"):
        cdf = data["cdf"][name]
        assert 0 < len(cdf["ms"]) <= CDF_POINTS and cdf["p"][0] == 0 and cdf["p"][-1] == 1
        assert cdf["ms"] == sorted(cdf["ms"])
        assert sum(data["histograms"][name]["count"]) == getattr(result.summary, name).count
    assert page.urls == []  # nothing to fetch: everything is inline
    assert not re.search(r"https?://(?!github\.com/leeoniya)", html.split("</style>")[-1])


def test_the_report_table_shows_the_summary_without_javascript() -> None:
    """Rule 3: the table's cells are the summary's values, as the text summary prints."""
    result = quick_run()
    _, _, page = _report(result, QUICK)
    s = result.summary
    for name, stats in (("ttft", s.ttft), ("tpot", s.tpot), ("e2e", s.e2e), ("queue", s.queue)):
        for column in ("min", "mean", "p50", "p90", "p95", "p99", "max"):
            value = getattr(stats, column)
            assert page.cells[f"{name}.{column}"] == f"{value:,.3f}"
        assert page.cells[f"{name}.count"] == f"{stats.count:,}"
    assert page.cells["requests"] == f"{s.requests_completed:,} completed, 0 refused"


def test_sim_writes_the_report_and_the_timeseries_csv(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, csv_path, js = tmp_path / "r.html", tmp_path / "t.csv", tmp_path / "r.json"
    argv = ["sim", "--config", str(GPT_OSS), "--hardware", "b200", "--workload", str(QUICK)]
    rc = cli.main([*argv, "-q", "--report", str(out), "--timeseries", str(csv_path),
                   "--series-interval", "2", "-o", str(js)])  # fmt: skip
    assert rc == 0
    doc = json.loads(js.read_text())
    page = _Page()
    page.feed(out.read_text())
    data = json.loads(page.data_json)
    assert data["summary"]["requests"] == doc["requests"]
    assert data["summary"]["latency_ms"] == doc["latency_ms"]
    rows = list(csv.DictReader(csv_path.open()))
    assert len(rows) == math.ceil(doc["time"]["simulated_s"] / 2)
    assert sum(int(r["finished"]) for r in rows) == doc["requests"]["completed"]
    assert float(rows[0]["t_end_s"]) == 2.0


def test_series_flags_are_checked_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sim", "--config", str(GPT_OSS), "--hardware", "b200", "--workload", str(QUICK), "-q"]
    assert cli.main([*argv, "--series-interval", "1"]) == 2
    assert "--series-interval applies to --report and --timeseries" in capsys.readouterr().err
    assert cli.main([*argv, "--report", str(tmp_path / "no" / "r.html")]) == 1
    assert "--report" in capsys.readouterr().err
    assert cli.main([*argv, "--timeseries", str(tmp_path), "--series-interval", "0"]) == 2
