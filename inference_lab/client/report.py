"""Turning a ``LoadResult`` into numbers: summary, percentiles, text, JSON and CSV.

Rule 1: latency figures (TTFT, inter-token latency, TPOT, E2E) cover the successful
  requests that *started* at or after the warm-up.
Rule 2: throughput is a rate over the measurement window ``[warmup, end]`` — ``end`` is
  ``duration`` for a timed run, else the end of the last request — counting the successful
  requests that *finished* inside it and their completion tokens. Requests that finish
  during the drain after ``duration`` count for latency but not for throughput.
Rule 3: the settled limit of an adaptive run is the time-weighted median of the limit over
  the final third of the load phase ``[2/3 · dispatch_end, dispatch_end]``.
Rule 4: JSON holds no NaN or infinity: a statistic with no samples is ``null``.
Rule 6: the server's pacing lag (``inference-lab-pacing-lag-ms``, an inference-lab
  server's) is summarized over the attempts started after the warm-up whose answer carried
  it; the report says the host was behind when its mean is at least
  :data:`LAG_EXPLAINS_MS` and :data:`LAG_EXPLAINS_SHARE` of the mean TTFT.
Rule 5: the first error is the first attempt, in start order, that did not succeed —
  except a 529 of an adaptive run, which is the controller's signal, not a failure. A run
  in which no attempt succeeded has ``all_failed`` set (the CLI exits 1 on it).
"""

from __future__ import annotations

import csv
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import cattrs
import numpy as np

from .load import OUTCOMES, RETRY_AFTER_CAP, LoadResult, RequestRecord

__all__ = [
    "AdaptiveSummary",
    "Distribution",
    "FirstError",
    "RetryAfterSummary",
    "Summary",
    "distribution",
    "format_summary",
    "settled_limit",
    "summarize",
    "write_csv",
    "write_json",
]


#: A mean pacing lag (ms) from which the report says the host, not the model, was behind
#: (Rule 6): a few hundred microseconds are the timer's and the loop's ordinary jitter ...
LAG_EXPLAINS_MS = 0.5
#: ... and a share of the mean TTFT below which the lag explains little of it.
LAG_EXPLAINS_SHARE = 0.1


@attrs.frozen
class Distribution:
    """Percentiles (linear interpolation) and mean of a sample, in seconds."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None


def distribution(values: Iterable[float] | np.ndarray[Any, Any]) -> Distribution:
    """Count, mean, p50/p90/p99 (linear interpolation) and max of ``values``; all None for
    an empty sample (Rule 4). ``summarize`` calls it for each latency."""
    a = np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype=float)
    if a.size == 0:
        return Distribution(0, None, None, None, None, None)
    p50, p90, p99 = (float(x) for x in np.percentile(a, [50, 90, 99]))
    return Distribution(int(a.size), float(a.mean()), p50, p90, p99, float(a.max()))


@attrs.frozen(kw_only=True)
class AdaptiveSummary:
    """What the AIMD controller did during an adaptive run (``Summary.adaptive``)."""

    settled_limit: int | None
    """Rule 3."""
    final_limit: int
    min_limit: int
    max_limit: int
    increases: int
    decreases: int
    overloaded: int
    """Attempts answered 529."""
    overload_rate: float
    """Fraction of all attempts answered 529."""
    retries: int
    """Attempts that were retries of a 529'd request."""
    given_up: int
    """Requests whose last attempt was still a 529 (``max_retries`` spent or run over)."""


@attrs.frozen(kw_only=True)
class FirstError:
    """The first attempt that did not succeed (Rule 5): what the server (or the
    connection) said."""

    index: int
    start: float
    """Seconds since the run started."""
    outcome: str
    status: int | None
    error_type: str | None
    error_code: str | None
    message: str | None


@attrs.frozen(kw_only=True)
class RetryAfterSummary:
    """What ``--retry-after`` did (``Summary.retry_after``)."""

    waits: int
    """Answers after which a slot stayed taken for their ``Retry-After``."""
    total: float
    """Seconds waited, over all waits."""
    longest: float
    capped: int
    """Waits cut to ``RETRY_AFTER_CAP``."""
    without_header: int
    """429 / 503 / 529 answers without a usable ``Retry-After``: the slot was freed at once."""


@attrs.frozen(kw_only=True)
class Summary:
    """The numbers of one run (``summarize``): what the CLI prints and ``-o`` writes.
    Latencies in seconds, throughputs per second of the measurement window."""

    mode: str
    run_time: float
    dispatch_end: float
    warmup: float
    window: float
    """Length of the measurement window (Rule 2); 0 if the run ended before the warm-up."""
    attempts: int
    requests: int
    outcomes: dict[str, int]
    """Every attempt, by outcome (``load.OUTCOMES``)."""
    measured_outcomes: dict[str, int]
    """Attempts started after the warm-up, by outcome."""
    request_throughput: float | None
    output_token_throughput: float | None
    total_token_throughput: float | None
    ttft: Distribution
    itl: Distribution
    tpot: Distribution
    e2e: Distribution
    prompt_tokens_mean: float | None
    completion_tokens_mean: float | None
    adaptive: AdaptiveSummary | None
    interrupted: bool
    first_error: FirstError | None = None
    all_failed: bool = False
    """At least one attempt, and none succeeded (Rule 5)."""
    retry_after: RetryAfterSummary | None = None
    """With ``--retry-after`` only."""
    pacing_lag: Distribution | None = None
    """The server's ``inference-lab-pacing-lag-ms`` over the measured answers that carried
    it (seconds; Rule 6); None when none did (another server)."""


def _completion_tokens(r: RequestRecord) -> int:
    return r.completion_tokens if r.completion_tokens is not None else len(r.token_times)


def summarize(result: LoadResult) -> Summary:
    """The run's numbers under Rules 1-3; called by the CLI after the run (and by tests)."""
    cfg = result.config
    records = result.records
    warmup = cfg.warmup
    window_end = cfg.duration if cfg.duration is not None else result.end
    window_end = min(window_end, result.end)
    window = max(0.0, window_end - warmup)

    measured = [r for r in records if r.start >= warmup]
    ok = [r for r in measured if r.outcome == "ok"]
    finished = [r for r in records if r.outcome == "ok" and warmup <= r.end <= window_end]
    out_tokens = sum(_completion_tokens(r) for r in finished)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in finished)

    itl_parts = [np.diff(np.frombuffer(r.token_times, dtype=float)) for r in ok]
    itl = np.concatenate(itl_parts) if itl_parts else np.empty(0)
    tpot = [
        (r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1)
        for r in ok
        if len(r.token_times) >= 2
    ]
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    completions = [_completion_tokens(r) for r in ok]

    def rate(x: float) -> float | None:
        return x / window if window > 0 else None

    lags = [r.pacing_lag for r in measured if r.pacing_lag is not None]
    return Summary(
        mode=cfg.mode,
        run_time=result.end,
        dispatch_end=result.dispatch_end,
        warmup=warmup,
        window=window,
        attempts=len(records),
        requests=len({r.request for r in records}),
        outcomes=_count(records),
        measured_outcomes=_count(measured),
        request_throughput=rate(len(finished)),
        output_token_throughput=rate(out_tokens),
        total_token_throughput=rate(out_tokens + prompt_tokens),
        ttft=distribution(r.ttft for r in ok if r.ttft is not None),
        itl=distribution(itl),
        tpot=distribution(tpot),
        e2e=distribution(r.e2e for r in ok),
        prompt_tokens_mean=sum(prompts) / len(prompts) if prompts else None,
        completion_tokens_mean=sum(completions) / len(completions) if completions else None,
        adaptive=_adaptive_summary(result),
        interrupted=result.interrupted,
        first_error=_first_error(result),
        all_failed=bool(records) and not any(r.outcome == "ok" for r in records),
        retry_after=_retry_after_summary(records) if cfg.retry_after else None,
        pacing_lag=distribution(lags) if lags else None,
    )


def _adaptive_summary(result: LoadResult) -> AdaptiveSummary | None:
    """Adaptive mode's figures (the controller's limits, 529s, retries, requests given
    up); None for another mode. ``summarize`` calls it."""
    if result.controller is None:
        return None
    records = result.records
    stats = result.controller
    overloaded = sum(1 for r in records if r.outcome == "overloaded")
    last_attempt: dict[int, RequestRecord] = {}
    for r in records:
        last_attempt[r.request] = r
    return AdaptiveSummary(
        settled_limit=settled_limit(result.limit_changes, result.dispatch_end),
        final_limit=stats.limit,
        min_limit=stats.min_limit_seen,
        max_limit=stats.max_limit_seen,
        increases=stats.increases,
        decreases=stats.decreases,
        overloaded=overloaded,
        overload_rate=overloaded / len(records) if records else 0.0,
        retries=sum(1 for r in records if r.attempt > 0),
        given_up=sum(1 for r in last_attempt.values() if r.outcome == "overloaded"),
    )


def _first_error(result: LoadResult) -> FirstError | None:
    """The first attempt, in start order, that did not succeed (in adaptive mode a 529 is
    the controller's signal, not an error); None if there is none."""
    failed = (
        r
        for r in result.records
        if r.outcome != "ok" and not (result.controller is not None and r.outcome == "overloaded")
    )
    first = next(failed, None)
    if first is None:
        return None
    return FirstError(
        index=first.index,
        start=first.start,
        outcome=first.outcome,
        status=first.status,
        error_type=first.error_type,
        error_code=first.error_code,
        message=first.error_message,
    )


def _retry_after_summary(records: Sequence[RequestRecord]) -> RetryAfterSummary:
    """With ``--retry-after``: the waits ``Retry-After`` asked for, capped ones, and the
    refusals that carried none."""
    waits = [r.retry_wait for r in records if r.retry_after is not None]
    refusals = [r for r in records if r.status in (429, 503, 529)]
    return RetryAfterSummary(
        waits=len(waits),
        total=sum(waits),
        longest=max(waits, default=0.0),
        capped=sum(
            1 for r in records if r.retry_after is not None and r.retry_after > RETRY_AFTER_CAP
        ),
        without_header=sum(1 for r in refusals if r.retry_after is None),
    )


def _count(records: Sequence[RequestRecord]) -> dict[str, int]:
    counts = Counter(r.outcome for r in records)
    return {name: counts[name] for name in OUTCOMES if counts[name]}


def settled_limit(changes: Sequence[tuple[float, int]], end: float) -> int | None:
    """Time-weighted median of the step function ``changes`` over ``[2/3·end, end]``."""
    if not changes or end <= 0:
        return None
    start = end * 2.0 / 3.0
    spans: dict[int, float] = {}
    for i, (t, value) in enumerate(changes):
        t_next = changes[i + 1][0] if i + 1 < len(changes) else end
        overlap = min(t_next, end) - max(t, start)
        if overlap > 0:
            spans[value] = spans.get(value, 0.0) + overlap
    if not spans:
        return changes[-1][1]
    half = sum(spans.values()) / 2.0
    acc = 0.0
    for value in sorted(spans):
        acc += spans[value]
        if acc >= half:
            return value
    return max(spans)  # pragma: no cover - float rounding only


# -- text --------------------------------------------------------------------------------

_LABELS = {
    "ok": "ok",
    "overloaded": "overloaded (529)",
    "unavailable": "unavailable (503)",
    "client_error": "other 4xx",
    "server_error": "other 5xx",
    "http_error": "other status",
    "stream_error": "stream error",
    "connection_error": "connection error",
    "timeout": "timeout",
    "cancelled": "cancelled",
}


def _plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def format_first_error(e: FirstError) -> str:
    """``HTTP 404 model_not_found: The model `x` does not exist.`` (the status, the error
    code or else its type or outcome, the message), for the summary and the CLI's line."""
    head = f"HTTP {e.status}" if e.status is not None else e.outcome
    what = e.error_code or e.error_type
    if what and what != head:
        head += f" {what}"
    return f"{head}: {e.message}" if e.message else head


def format_summary(result: LoadResult, summary: Summary) -> str:
    """The human-readable report the CLI prints."""
    cfg = result.config
    if cfg.mode == "closed":
        mode = f"closed loop, concurrency {cfg.concurrency}"
    elif cfg.mode == "open":
        cap = f", max {cfg.max_concurrency} in flight" if cfg.max_concurrency else ""
        mode = f"open loop, Poisson {cfg.rate:g} req/s{cap}"
    else:
        mode = f"adaptive AIMD, start {cfg.start_limit}, ceiling {cfg.ceiling}"
    kind = f"{cfg.endpoint}, {'stream' if cfg.stream else 'no stream'}"
    lines = [
        f"load: {mode} | {kind} | {cfg.prompt_tokens} prompt / {cfg.max_tokens} max tokens",
        f"ran {summary.run_time:.1f} s (warm-up {cfg.warmup:g} s): {summary.attempts} attempts"
        f" for {summary.requests} requests" + (" — interrupted" if summary.interrupted else ""),
        "outcomes: "
        + (
            " · ".join(f"{_LABELS[k]} {v}" for k, v in summary.outcomes.items())
            if summary.outcomes
            else "none"
        ),
        f"throughput over {summary.window:.1f} s after warm-up: "
        f"{_num(summary.request_throughput)} req/s · "
        f"{_num(summary.output_token_throughput, '.1f')} output tok/s · "
        f"{_num(summary.total_token_throughput, '.1f')} total tok/s",
        f"latency over {summary.e2e.count} ok requests started after warm-up (ms):",
        f"  {'':6}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}{'n':>9}",
    ]
    for name, d in (
        ("TTFT", summary.ttft),
        ("ITL", summary.itl),
        ("TPOT", summary.tpot),
        ("E2E", summary.e2e),
    ):
        lines.append(
            f"  {name:6}{_ms(d.p50):>10}{_ms(d.p90):>10}{_ms(d.p99):>10}{_ms(d.mean):>10}"
            f"{d.count:>9}"
        )
    lines.extend(_lag_lines(summary))
    if summary.first_error is not None:
        e = summary.first_error
        lines.append(
            f"first error (attempt {e.index}, at {e.start:.2f} s): {format_first_error(e)}"
        )
    ra = summary.retry_after
    if ra is not None:
        text = (
            f"retry-after: {_plural(ra.waits, 'wait')} for Retry-After, {ra.total:.1f} s in all"
            f" (longest {ra.longest:.1f} s)"
        )
        if ra.capped:
            text += f" · {ra.capped} capped at {RETRY_AFTER_CAP:g} s"
        if ra.without_header:
            text += f" · {ra.without_header} refusals without Retry-After, resent at once"
        lines.append(text)
    a = summary.adaptive
    if a is not None:
        settled = "-" if a.settled_limit is None else str(a.settled_limit)
        lines.append(
            f"adaptive: settled limit {settled} (median over the final third) · "
            f"final {a.final_limit} · range {a.min_limit}–{a.max_limit} · "
            f"{_plural(a.increases, 'raise')}, {_plural(a.decreases, 'cut')} · "
            f"529 on {a.overload_rate:.1%} of attempts · {_plural(a.retries, 'retry', 'retries')}"
            + (f" · {a.given_up} given up" if a.given_up else "")
        )
    return "\n".join(lines)


def _lag_lines(summary: Summary) -> list[str]:
    """The server's pacing lag (Rule 6): its mean and max, and a sentence when it is large
    enough to explain the TTFT measured."""
    lag = summary.pacing_lag
    if lag is None or lag.mean is None or lag.max is None:
        return []
    lines = [
        f"server pacing lag at admission (inference-lab-pacing-lag-ms, {lag.count} answers):"
        f" mean {lag.mean * 1e3:.2f} ms · max {lag.max * 1e3:.2f} ms"
    ]
    ttft = summary.ttft.mean
    if lag.mean * 1e3 >= LAG_EXPLAINS_MS and (
        ttft is None or lag.mean >= LAG_EXPLAINS_SHARE * ttft
    ):
        share = f", {lag.mean / ttft:.0%} of the mean TTFT" if ttft else ""
        lines.append(
            f"  the server's host was behind: its engine ran {lag.mean * 1e3:.1f} ms late on "
            f"average when these requests arrived{share}; that much of the latency above is "
            "the host's CPU, not the model"
        )
    return lines


# -- files -------------------------------------------------------------------------------

_converter = cattrs.Converter()


def to_json_obj(result: LoadResult, summary: Summary) -> dict[str, Any]:
    """The ``-o`` document: config, summary, time series, limit changes, pool counters."""
    return {
        "config": _converter.unstructure(result.config),
        "started_at": result.started_at,
        "summary": _converter.unstructure(summary),
        "timeseries": _converter.unstructure(list(result.samples)),
        "limit_changes": [list(c) for c in result.limit_changes],
        "connections": _converter.unstructure(result.pool),
    }


def write_json(path: Path, result: LoadResult, summary: Summary) -> None:
    """Write the ``-o`` document (``to_json_obj``) to ``path``; OSError if it cannot."""
    text = json.dumps(to_json_obj(result, summary), indent=2, allow_nan=False)
    path.write_text(text + "\n", encoding="utf-8")


CSV_COLUMNS = (
    "index",
    "request",
    "attempt",
    "start",
    "end",
    "status",
    "outcome",
    "error_type",
    "error_code",
    "error_message",
    "ttft",
    "e2e",
    "prompt_tokens",
    "completion_tokens",
    "tokens_received",
    "finish_reason",
    "after_warmup",
    "retry_after",
    "retry_wait",
    "token_times",
)


def _f(x: float | None) -> str:
    return "" if x is None else f"{x:.6f}"


def _s(x: object) -> str:
    return "" if x is None else str(x)


def write_csv(path: Path, result: LoadResult) -> None:
    """One row per attempt. Times in seconds: ``start``/``end`` since the run started,
    ``ttft`` and ``token_times`` (``;``-separated, one per token) since the request started."""
    warmup = result.config.warmup
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(CSV_COLUMNS)
        for r in result.records:
            writer.writerow(
                (
                    r.index,
                    r.request,
                    r.attempt,
                    _f(r.start),
                    _f(r.end),
                    _s(r.status),
                    r.outcome,
                    _s(r.error_type),
                    _s(r.error_code),
                    _s(r.error_message),
                    _f(r.ttft),
                    _f(r.e2e),
                    _s(r.prompt_tokens),
                    _s(r.completion_tokens),
                    len(r.token_times),
                    _s(r.finish_reason),
                    int(r.start >= warmup),
                    _f(r.retry_after),
                    _f(r.retry_wait) if r.retry_wait else "",
                    ";".join(f"{t:.6f}" for t in r.token_times),
                )
            )
