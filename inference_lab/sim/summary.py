"""Offline-simulation metrics: per-request latencies, throughput, utilisation.

Rule 1: pure functions of what the engine reported (`Finished` records and `StepInfo`
        batches); nothing here reads a clock or touches the engine.
Rule 2: latencies are computed in seconds and reported in milliseconds, as
        min / mean / p50 / p90 / p95 / p99 / max with numpy's linear-interpolation percentiles.
        An empty set (e.g. TPOT when every request produced one token) reports count 0 and
        None for every statistic (JSON null), never NaN.
Rule 3: TPOT is defined only for requests with more than one output token; refused requests
        never enter the latency statistics, they are counted apart. A request of ``n``
        sequences is one latency sample (its sequences finish together) and ``n`` times
        its output tokens in the throughput.
Rule 4: throughput is measured over the simulated span, from the first arrival to the last
        completion (the idle time before the first arrival is not the server's).
Rule 5: the prefix cache is reported in tokens, from the engine's counters (queries and
        hits at every admission, re-admissions after a preemption included) and the
        requests' own ``cached_tokens`` (at their first admission); a replica's requests
        are the completed requests it ran.
Rule 6: speculative decoding is reported from the steps' counters as vLLM reports it: the
        mean acceptance length is ``1 + accepted tokens / drafts``; the speed-up is the
        time the steps' tokens would have taken without speculation (each step's
        ``plain_duration``: its batch without drafts, then the extra decode steps its
        accepted tokens would have needed) over the time they took.

Who calls this: `inference_lab.sim.run` after a run; tests with hand-made records.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from inference_lab.sim.records import FinishedTable, StepTotals

__all__ = [
    "PERCENTILES",
    "LATENCY_COLUMNS",
    "FinishedLike",
    "LatencyStats",
    "PrefixCacheSummary",
    "ReplicaSummary",
    "RequestLatencies",
    "SessionSummary",
    "SimSummary",
    "SpeculativeSummary",
    "StepLike",
    "prefix_cache_summary",
    "replica_summaries",
    "request_latencies",
    "session_summary",
    "speculative_summary",
    "summarize",
]

PERCENTILES: tuple[int, ...] = (50, 90, 95, 99)
#: The statistics of a latency, in table / JSON order.
LATENCY_COLUMNS: tuple[str, ...] = ("min", "mean", "p50", "p90", "p95", "p99", "max")


class FinishedLike(Protocol):
    """What metrics need from a finished request (`engine.Finished` has these fields)."""

    @property
    def prompt_tokens(self) -> int: ...
    @property
    def output_tokens(self) -> int: ...
    @property
    def arrival_time(self) -> float: ...
    @property
    def first_scheduled_time(self) -> float: ...
    @property
    def first_token_time(self) -> float: ...
    @property
    def finish_time(self) -> float: ...
    @property
    def n(self) -> int: ...
    @property
    def request_id(self) -> int: ...
    @property
    def cached_tokens(self) -> int: ...
    @property
    def worker(self) -> int: ...


class StatsLike(Protocol):
    """What the prefix-cache figures need from the engine (`EngineStatistics`)."""

    @property
    def prefix_caching(self) -> bool: ...
    @property
    def prefix_cache_queries(self) -> int: ...
    @property
    def prefix_cache_hits(self) -> int: ...
    @property
    def workers(self) -> Sequence[WorkerStatsLike]: ...


class WorkerStatsLike(Protocol):
    @property
    def prefix_cache_queries(self) -> int: ...
    @property
    def prefix_cache_hits(self) -> int: ...


class SessionLike(Protocol):
    """What the session figures need from a request's arrival (`workload.Arrival`)."""

    @property
    def session(self) -> int: ...
    @property
    def turn(self) -> int: ...


class StepLike(Protocol):
    """What metrics need from one engine step (`engine.StepInfo` has these fields)."""

    @property
    def kv_usage(self) -> float: ...
    @property
    def flop_util(self) -> float: ...
    @property
    def bw_util(self) -> float: ...
    @property
    def preempted(self) -> int: ...


def _opt(x: float | None) -> float | None:
    return None if x is None else float(x)


@attrs.frozen(kw_only=True)
class LatencyStats:
    """Distribution of one latency in milliseconds; every statistic is None when count is 0."""

    count: int
    min: float | None = attrs.field(converter=_opt)
    mean: float | None = attrs.field(converter=_opt)
    p50: float | None = attrs.field(converter=_opt)
    p90: float | None = attrs.field(converter=_opt)
    p95: float | None = attrs.field(converter=_opt)
    p99: float | None = attrs.field(converter=_opt)
    max: float | None = attrs.field(converter=_opt)

    @classmethod
    def from_seconds(cls, seconds: npt.ArrayLike) -> LatencyStats:
        """Statistics of `seconds` (any shape, flattened), reported in ms."""
        ms = np.asarray(seconds, dtype=np.float64).ravel() * 1e3
        if ms.size == 0:
            return cls(
                count=0, min=None, mean=None, p50=None, p90=None, p95=None, p99=None, max=None
            )
        p50, p90, p95, p99 = np.percentile(ms, PERCENTILES, method="linear").tolist()
        return cls(
            count=int(ms.size),
            min=float(ms.min()),
            mean=float(ms.mean()),
            p50=p50,
            p90=p90,
            p95=p95,
            p99=p99,
            max=float(ms.max()),
        )

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen(kw_only=True)
class SimSummary:
    """The result of one simulation, as reported by `sim` (table and JSON)."""

    requests_submitted: int  # completed + refused (+ any still in flight, 0 after a drain)
    requests_completed: int
    requests_refused: int
    ttft: LatencyStats
    tpot: LatencyStats
    e2e: LatencyStats
    queue: LatencyStats
    input_tokens: int  # prompt tokens of completed requests
    output_tokens: int  # output tokens of completed requests (n per step for a group)
    span_s: float  # first arrival -> last completion, simulated seconds
    input_tokens_per_s: float
    output_tokens_per_s: float
    requests_per_s: float
    steps: int  # engine steps (batches) run, over all workers
    kv_usage_mean: float  # fractions in [0, 1], means over steps
    kv_usage_max: float
    flop_util_mean: float
    bw_util_mean: float
    preemptions: int

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict: plain ints, floats, None, nested dicts."""
        return {
            "requests": {
                "submitted": self.requests_submitted,
                "completed": self.requests_completed,
                "refused": self.requests_refused,
            },
            "latency_ms": {
                "ttft": self.ttft.to_dict(),
                "tpot": self.tpot.to_dict(),
                "e2e": self.e2e.to_dict(),
                "queue": self.queue.to_dict(),
            },
            "throughput": {
                "span_s": self.span_s,
                "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens,
                "input_tokens_per_s": self.input_tokens_per_s,
                "output_tokens_per_s": self.output_tokens_per_s,
                "requests_per_s": self.requests_per_s,
            },
            "utilisation": {
                "steps": self.steps,
                "kv_usage_mean": self.kv_usage_mean,
                "kv_usage_max": self.kv_usage_max,
                "flop_util_mean": self.flop_util_mean,
                "bw_util_mean": self.bw_util_mean,
            },
            "preemptions": self.preemptions,
        }


def _column(records: Sequence[FinishedLike], name: str) -> npt.NDArray[np.float64]:
    if isinstance(records, FinishedTable):  # compact records: the column as it is kept
        return records.column(name).astype(np.float64, copy=False)
    return np.fromiter((getattr(r, name) for r in records), dtype=np.float64, count=len(records))


def _mean(steps: Sequence[StepLike] | StepTotals, name: str) -> float:
    if not len(steps):
        return 0.0
    if isinstance(steps, StepTotals):
        return float(steps.column(name).mean())
    return float(np.fromiter((getattr(s, name) for s in steps), np.float64, len(steps)).mean())


def summarize(
    finished: Sequence[FinishedLike],
    steps: Sequence[StepLike] | StepTotals,
    *,
    refused: int = 0,
    first_arrival: float | None = None,
) -> SimSummary:
    """Summarise a finished simulation.

    `first_arrival` starts the throughput span (default: the earliest completed request's
    arrival; pass the earliest arrival overall so refused requests' time counts too).
    """
    arrival = _column(finished, "arrival_time")
    scheduled = _column(finished, "first_scheduled_time")
    first_token = _column(finished, "first_token_time")
    finish = _column(finished, "finish_time")
    output = _column(finished, "output_tokens")
    prompt = _column(finished, "prompt_tokens")

    multi = output > 1
    tpot = (finish[multi] - first_token[multi]) / (output[multi] - 1)

    if finished:
        start = float(arrival.min()) if first_arrival is None else first_arrival
        span = max(float(finish.max()) - start, 0.0)
    else:
        span = 0.0
    input_tokens = int(prompt.sum())
    output_tokens = int((output * _column(finished, "n")).sum())

    def rate(x: float) -> float:
        return x / span if span > 0 else 0.0

    if isinstance(steps, StepTotals):
        kv_max = max(steps.kv_usage, default=0.0)
        preemptions = steps.preempted
    else:
        kv_max = max((s.kv_usage for s in steps), default=0.0)
        preemptions = sum(s.preempted for s in steps)
    return SimSummary(
        requests_submitted=len(finished) + refused,
        requests_completed=len(finished),
        requests_refused=refused,
        ttft=LatencyStats.from_seconds(first_token - arrival),
        tpot=LatencyStats.from_seconds(tpot),
        e2e=LatencyStats.from_seconds(finish - arrival),
        queue=LatencyStats.from_seconds(scheduled - arrival),
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        span_s=span,
        input_tokens_per_s=rate(input_tokens),
        output_tokens_per_s=rate(output_tokens),
        requests_per_s=rate(len(finished)),
        steps=len(steps),
        kv_usage_mean=_mean(steps, "kv_usage"),
        kv_usage_max=float(kv_max),
        flop_util_mean=_mean(steps, "flop_util"),
        bw_util_mean=_mean(steps, "bw_util"),
        preemptions=preemptions,
    )


def _rate(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


class SpecStepLike(Protocol):
    """What the speculative figures need from one step (`engine.StepInfo` has these)."""

    @property
    def duration(self) -> float: ...
    @property
    def drafts(self) -> int: ...
    @property
    def draft_tokens(self) -> int: ...
    @property
    def accepted_tokens(self) -> int: ...
    @property
    def plain_duration(self) -> float: ...


@attrs.frozen(kw_only=True)
class SpeculativeSummary:
    """Speculative decoding over a run (Rule 6)."""

    drafts: int  # sequences that verified draft tokens, summed over steps
    draft_tokens: int
    accepted_tokens: int
    #: The steps' time, and the time they would have taken without drafts to emit the
    #: same tokens (seconds).
    time_s: float
    plain_time_s: float

    @property
    def mean_acceptance_length(self) -> float:
        """``1 + accepted / drafts`` (vLLM's definition; 1 without drafts)."""
        return 1.0 + _rate(self.accepted_tokens, self.drafts)

    @property
    def acceptance_rate(self) -> float:
        return _rate(self.accepted_tokens, self.draft_tokens)

    @property
    def speedup(self) -> float:
        return self.plain_time_s / self.time_s if self.time_s > 0 else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "speedup": self.speedup,
        }


def speculative_summary(steps: Sequence[SpecStepLike] | StepTotals) -> SpeculativeSummary:
    """Rule 6 over the steps of a speculative run (a step without drafts counts the same
    with and without speculation)."""
    if isinstance(steps, StepTotals):  # summed the same way as the steps came
        return SpeculativeSummary(
            drafts=steps.drafts,
            draft_tokens=steps.draft_tokens,
            accepted_tokens=steps.accepted_tokens,
            time_s=steps.time_s,
            plain_time_s=steps.plain_time_s,
        )
    drafts = draft_tokens = accepted = 0
    time_s = plain_s = 0.0
    for s in steps:
        time_s += s.duration
        d = s.drafts
        if d:
            drafts += d
            draft_tokens += s.draft_tokens
            accepted += s.accepted_tokens
            plain_s += s.plain_duration
        else:
            plain_s += s.duration
    return SpeculativeSummary(
        drafts=drafts,
        draft_tokens=draft_tokens,
        accepted_tokens=accepted,
        time_s=time_s,
        plain_time_s=plain_s,
    )


@attrs.frozen(kw_only=True)
class PrefixCacheSummary:
    """The prefix cache over a run (Rule 5): tokens looked up and found at admissions,
    and the completed requests that found some of their prompt cached."""

    enabled: bool
    query_tokens: int
    hit_tokens: int  # = prefill tokens not computed
    requests: int  # completed requests
    requests_hit: int  # of them, with cached_tokens > 0 at their first admission

    @property
    def hit_rate(self) -> float:
        return _rate(self.hit_tokens, self.query_tokens)

    def to_dict(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "query_tokens": self.query_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": self.hit_rate,
            "prefill_tokens_saved": self.hit_tokens,
            "requests": self.requests,
            "requests_hit": self.requests_hit,
        }


def prefix_cache_summary(stats: StatsLike, finished: Sequence[FinishedLike]) -> PrefixCacheSummary:
    return PrefixCacheSummary(
        enabled=stats.prefix_caching,
        query_tokens=stats.prefix_cache_queries,
        hit_tokens=stats.prefix_cache_hits,
        requests=len(finished),
        requests_hit=(
            int(np.count_nonzero(finished.column("cached_tokens") > 0))
            if isinstance(finished, FinishedTable)
            else sum(1 for f in finished if f.cached_tokens > 0)
        ),
    )


@attrs.frozen(kw_only=True)
class ReplicaSummary:
    """One replica: the completed requests it ran and its prefix-cache tokens."""

    replica: int
    requests: int
    query_tokens: int
    hit_tokens: int

    @property
    def hit_rate(self) -> float:
        return _rate(self.hit_tokens, self.query_tokens)

    def to_dict(self) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "requests": self.requests,
            "query_tokens": self.query_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": self.hit_rate,
        }


def replica_summaries(
    stats: StatsLike, finished: Sequence[FinishedLike]
) -> tuple[ReplicaSummary, ...]:
    counts = [0] * len(stats.workers)
    if isinstance(finished, FinishedTable):
        counts = np.bincount(finished.column("worker"), minlength=len(counts)).tolist()
    else:
        for f in finished:
            counts[f.worker] += 1
    return tuple(
        ReplicaSummary(
            replica=i,
            requests=counts[i],
            query_tokens=w.prefix_cache_queries,
            hit_tokens=w.prefix_cache_hits,
        )
        for i, w in enumerate(stats.workers)
    )


@attrs.frozen(kw_only=True)
class TurnStats:
    """The completed requests that were turn ``turn`` (0 = first) of their session."""

    turn: int
    requests: int
    ttft: LatencyStats
    prompt_tokens: int
    cached_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "turn": self.turn,
            "requests": self.requests,
            "ttft_ms": self.ttft.to_dict(),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "cached_fraction": _rate(self.cached_tokens, self.prompt_tokens),
        }


@attrs.frozen(kw_only=True)
class SessionSummary:
    """A session workload: how many sessions and turns completed, and per turn index the
    TTFT and the share of the prompts found cached."""

    sessions: int
    turns: int
    by_turn: tuple[TurnStats, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "sessions": self.sessions,
            "turns": self.turns,
            "by_turn": [t.to_dict() for t in self.by_turn],
        }


def session_summary(
    finished: Sequence[FinishedLike], arrivals: Mapping[int, SessionLike]
) -> SessionSummary:
    by_turn: dict[int, list[FinishedLike]] = {}
    sessions = set()
    for f in finished:
        a = arrivals[f.request_id]
        sessions.add(a.session)
        by_turn.setdefault(a.turn, []).append(f)
    turns = tuple(
        TurnStats(
            turn=k,
            requests=len(rs),
            ttft=LatencyStats.from_seconds([r.first_token_time - r.arrival_time for r in rs]),
            prompt_tokens=sum(r.prompt_tokens for r in rs),
            cached_tokens=sum(r.cached_tokens for r in rs),
        )
        for k, rs in sorted(by_turn.items())
    )
    return SessionSummary(sessions=len(sessions), turns=len(finished), by_turn=turns)


@attrs.frozen(kw_only=True, eq=False)
class RequestLatencies:
    """Each completed request's latencies in seconds, aligned by index (completion order),
    with the definitions `summarize` uses: TTFT, E2E and queue from the arrival; TPOT NaN
    for a request of one output token (Rule 3). Who uses it: the capacity planner, which
    needs any percentile and each request's own verdict, not only the summary's four."""

    ttft: npt.NDArray[np.float64]
    tpot: npt.NDArray[np.float64]
    e2e: npt.NDArray[np.float64]
    queue: npt.NDArray[np.float64]
    output_tokens: npt.NDArray[np.int64]  # per request (n sequences: n times each one's)


def request_latencies(finished: Sequence[FinishedLike]) -> RequestLatencies:
    """The per-request latencies of `finished` (see `RequestLatencies`)."""
    arrival = _column(finished, "arrival_time")
    first_token = _column(finished, "first_token_time")
    finish = _column(finished, "finish_time")
    output = _column(finished, "output_tokens")
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot = np.where(output > 1, (finish - first_token) / (output - 1), np.nan)
    return RequestLatencies(
        ttft=first_token - arrival,
        tpot=tpot,
        e2e=finish - arrival,
        queue=_column(finished, "first_scheduled_time") - arrival,
        output_tokens=(output * _column(finished, "n")).astype(np.int64),
    )
