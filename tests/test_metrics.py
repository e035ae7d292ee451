"""Offline metrics: latency statistics, TPOT, throughput span, step means, refusals."""

from __future__ import annotations

import json

import attrs
import numpy as np
import pytest

from inference_lab.core.engine import Finished, StepInfo
from inference_lab.sim.summary import LATENCY_COLUMNS, LatencyStats, summarize


def finished(
    rid: int,
    arrival: float,
    scheduled: float,
    first_token: float,
    finish: float,
    output: int,
    prompt: int = 100,
) -> Finished:
    return Finished(
        request_id=rid,
        prompt_tokens=prompt,
        output_tokens=output,
        finish_reason="length",
        arrival_time=arrival,
        first_scheduled_time=scheduled,
        first_token_time=first_token,
        finish_time=finish,
        preemptions=0,
    )


def step(kv: float, flop: float, bw: float, preempted: int = 0) -> StepInfo:
    return StepInfo(
        worker=0,
        start=0.0,
        duration=0.01,
        num_seqs=1,
        num_tokens=1,
        kv_usage=kv,
        flop_util=flop,
        bw_util=bw,
        preempted=preempted,
    )


# Hand-made: arrivals 1 s apart; TTFT 10, 20, ..., 70 ms (+ a 1 s outlier); queue 0..7 ms.
RECORDS = [
    finished(i, float(i), i + 0.001 * i, i + 0.010 * (i + 1), i + 0.5 + 0.1 * i, output=11 + i)
    for i in range(7)
] + [finished(7, 7.0, 7.007, 8.0, 9.0, output=1, prompt=50)]


def test_latency_percentiles_match_numpy_linear() -> None:
    """min/mean/p50/p90/p95/p99/max are numpy's (linear interpolation), reported in ms."""
    summary = summarize(RECORDS, [])
    ttft_ms = np.array([r.first_token_time - r.arrival_time for r in RECORDS]) * 1e3
    expected = {
        "min": ttft_ms.min(),
        "mean": ttft_ms.mean(),
        "p50": np.percentile(ttft_ms, 50),
        "p90": np.percentile(ttft_ms, 90),
        "p95": np.percentile(ttft_ms, 95),
        "p99": np.percentile(ttft_ms, 99),
        "max": ttft_ms.max(),
    }
    for column in LATENCY_COLUMNS:
        assert getattr(summary.ttft, column) == pytest.approx(expected[column], rel=1e-12)
    # spot-check the interpolation by hand: 8 values 10..70, 1000 -> p90 = 70 + 0.3 * 930
    assert summary.ttft.p90 == pytest.approx(70 + 0.3 * 930)
    assert summary.ttft.count == 8


def test_e2e_and_queue_are_measured_from_arrival() -> None:
    """E2E = finish - arrival; queue = first admission - arrival."""
    summary = summarize(RECORDS, [])
    e2e = [(r.finish_time - r.arrival_time) * 1e3 for r in RECORDS]
    queue = [(r.first_scheduled_time - r.arrival_time) * 1e3 for r in RECORDS]
    assert summary.e2e.max == pytest.approx(max(e2e))
    assert summary.e2e.mean == pytest.approx(np.mean(e2e))
    assert summary.queue.min == pytest.approx(0.0, abs=1e-9)
    assert summary.queue.max == pytest.approx(max(queue))
    assert summary.queue.p50 == pytest.approx(np.percentile(queue, 50))


def test_tpot_excludes_single_token_requests() -> None:
    """TPOT = (finish - first token) / (output - 1), over requests with output > 1 only."""
    summary = summarize(RECORDS, [])
    multi = [r for r in RECORDS if r.output_tokens > 1]
    tpot = [(r.finish_time - r.first_token_time) / (r.output_tokens - 1) * 1e3 for r in multi]
    assert summary.tpot.count == 7
    assert summary.tpot.mean == pytest.approx(np.mean(tpot))
    assert summary.tpot.max == pytest.approx(max(tpot))


def test_empty_latency_is_null_not_nan() -> None:
    """With only single-token requests TPOT has count 0 and None values; the dict is valid JSON."""
    only_one = [finished(0, 0.0, 0.0, 0.1, 0.1, output=1)]
    summary = summarize(only_one, [])
    assert summary.tpot.count == 0
    assert all(getattr(summary.tpot, c) is None for c in LATENCY_COLUMNS)
    json.dumps(summary.to_dict(), allow_nan=False)
    assert LatencyStats.from_seconds([]).to_dict()["p99"] is None


def test_throughput_is_over_first_arrival_to_last_completion() -> None:
    """Tokens/s and requests/s divide by the span from the first arrival to the last finish."""
    summary = summarize(RECORDS, [])
    span = 9.0 - 0.0
    assert summary.span_s == pytest.approx(span)
    assert summary.output_tokens == sum(r.output_tokens for r in RECORDS)
    assert summary.input_tokens == 7 * 100 + 50
    assert summary.output_tokens_per_s == pytest.approx(summary.output_tokens / span)
    assert summary.input_tokens_per_s == pytest.approx(750 / span)
    assert summary.requests_per_s == pytest.approx(8 / span)
    # an earlier first arrival (e.g. a refused request's) widens the span
    wider = summarize(RECORDS, [], first_arrival=-1.0)
    assert wider.span_s == pytest.approx(10.0)


def test_step_means_and_preemptions() -> None:
    """KV use, FLOP and bandwidth utilisation are plain means over steps; preemptions sum."""
    steps = [step(0.1, 0.2, 0.9), step(0.3, 0.4, 0.7, preempted=2), step(0.8, 0.0, 0.5, 1)]
    summary = summarize(RECORDS, steps)
    assert summary.steps == 3
    assert summary.kv_usage_mean == pytest.approx(0.4)
    assert summary.kv_usage_max == pytest.approx(0.8)
    assert summary.flop_util_mean == pytest.approx(0.2)
    assert summary.bw_util_mean == pytest.approx(0.7)
    assert summary.preemptions == 3


def test_refused_requests_are_counted_apart() -> None:
    """Refusals add to submitted and refused, never to the latency statistics."""
    summary = summarize(RECORDS, [], refused=3)
    assert summary.requests_refused == 3
    assert summary.requests_completed == 8
    assert summary.requests_submitted == 11
    assert summary.ttft.count == 8


def test_summary_dict_is_json_with_the_documented_keys() -> None:
    """The JSON form has the sections the CLI writes with `-o`."""
    doc = json.loads(json.dumps(summarize(RECORDS, [step(0.5, 0.5, 0.5)]).to_dict()))
    assert set(doc) == {"requests", "latency_ms", "throughput", "utilisation", "preemptions"}
    assert set(doc["latency_ms"]) == {"ttft", "tpot", "e2e", "queue"}
    assert set(doc["latency_ms"]["ttft"]) == {"count", *LATENCY_COLUMNS}


def test_no_requests_no_division_by_zero() -> None:
    """An empty run (everything refused) summarises to zeros, not an exception."""
    summary = summarize([], [], refused=5)
    assert summary.requests_completed == 0
    assert summary.span_s == 0.0
    assert summary.output_tokens_per_s == 0.0
    assert summary.ttft.count == 0


def test_a_group_of_n_choices_counts_n_times_its_output_tokens() -> None:
    """A request of n sequences is one latency sample but n * output_tokens in the
    throughput (output_tokens is per choice)."""
    one = finished(0, 0.0, 0.0, 0.1, 1.0, output=10)
    group = attrs.evolve(finished(1, 0.0, 0.0, 0.1, 1.0, output=10), n=3)
    summary = summarize([one, group], [])
    assert summary.output_tokens == 10 + 30
    assert summary.tpot.count == 2 and summary.requests_completed == 2
