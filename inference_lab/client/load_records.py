"""The load generator's values: a run's parameters (``LoadConfig``, validated on
construction), one attempt's record, the time-series samples and a run's result, and
what an answer's status makes of an attempt (:mod:`.load` runs them).

Rule 1: a ``LoadConfig`` that exists is valid: every option is checked on construction,
  each failure one ``ValueError`` line naming the option.
Rule 2: an attempt's state is mutable only while it runs (``Attempt``); what leaves the
  run is the frozen ``RequestRecord``, its times relative to the run's start.
"""

from __future__ import annotations

from array import array
from typing import Literal

import attrs

from .aimd import AIMDStatistics
from .http import PoolStatistics, parse_base_url
from .wire import Endpoint

Outcome = Literal[
    "ok",
    "overloaded",
    "unavailable",
    "client_error",
    "server_error",
    "http_error",
    "stream_error",
    "connection_error",
    "timeout",
    "cancelled",
]
OUTCOMES: tuple[Outcome, ...] = (
    "ok",  # 200 and a complete response (stream: [DONE] seen, no error frame)
    "overloaded",  # 529 overloaded_error: the only overload signal
    "unavailable",  # 503 (engine not running): not an overload signal
    "client_error",  # other 4xx
    "server_error",  # other 5xx
    "http_error",  # any other non-200 status
    "stream_error",  # 200 but an error frame, a cut-off stream or an unreadable body
    "connection_error",  # connect failed, reset, EOF or protocol violation
    "timeout",  # request_timeout passed
    "cancelled",  # still running at the hard stop (drain time-out or interrupt)
)


class LoadError(Exception):
    """Raised by ``run_load`` when the run cannot start: the server is unreachable, or
    (``check_model``) its model list cannot be read or lacks the model. The CLI prints
    the one-line message and exits 1."""


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


@attrs.frozen(kw_only=True)
class LoadConfig:
    """One run's parameters, validated on construction (``ValueError``, one line, naming the
    option). The CLI builds it from ``argparse``; tests build it directly."""

    url: str
    model: str
    concurrency: int | None = None
    """Closed loop: the number of workers. Adaptive: the starting limit (default 1)."""
    rate: float | None = None
    """Open loop: Poisson arrivals per second."""
    max_concurrency: int | None = None
    """Open loop: cap on requests in flight (default none). Adaptive: the ceiling (1024)."""
    duration: float | None = None
    requests: int | None = None
    warmup: float = 0.0
    prompt_tokens: int = 50
    max_tokens: int = 200
    stream: bool = True
    endpoint: Endpoint = "chat"
    adaptive: Literal["aimd"] | None = None
    window: int = 8
    backoff: float = 0.5
    max_retries: int = 10
    request_timeout: float = 300.0
    drain_timeout: float = 30.0
    sample_interval: float = 0.25
    connect_timeout: float = 10.0
    seed: int | None = None
    check_model: bool = True
    """Ask ``GET /v1/models`` before the run whether ``model`` is served (Rule 6)."""
    retry_after: bool = False
    """Honour ``Retry-After`` on 429 / 503 / 529 (Rule 7); closed loop and adaptive only."""

    def __attrs_post_init__(self) -> None:
        parse_base_url(self.url)
        _check(bool(self.model), "--model must not be empty")
        if self.adaptive is not None:
            _check(self.adaptive == "aimd", f"--adaptive must be 'aimd', got {self.adaptive!r}")
            _check(self.rate is None, "--rate is not allowed with --adaptive")
        else:
            _check(
                (self.concurrency is None) != (self.rate is None),
                "give exactly one of --concurrency and --rate",
            )
            _check(
                self.max_concurrency is None or self.rate is not None,
                "--max-concurrency needs --rate or --adaptive",
            )
        _check(
            (self.duration is None) != (self.requests is None),
            "give exactly one of --duration and --requests",
        )
        for name in ("concurrency", "max_concurrency", "requests"):
            value = getattr(self, name)
            _check(value is None or value >= 1, f"--{name.replace('_', '-')} must be >= 1")
        _check(self.rate is None or self.rate > 0, "--rate must be > 0")
        _check(self.duration is None or self.duration > 0, "--duration must be > 0")
        _check(self.warmup >= 0, "--warmup must be >= 0")
        _check(
            self.duration is None or self.warmup < self.duration,
            "--warmup must be shorter than --duration",
        )
        _check(self.prompt_tokens >= 1, "--prompt-tokens must be >= 1")
        _check(self.max_tokens >= 1, "--max-tokens must be >= 1")
        _check(self.endpoint in ("chat", "completions"), "--endpoint must be chat or completions")
        _check(self.window >= 1, "--window must be >= 1")
        _check(0 < self.backoff < 1, "--backoff must be > 0 and < 1")
        _check(self.max_retries >= 0, "--max-retries must be >= 0")
        for name in ("request_timeout", "drain_timeout", "sample_interval", "connect_timeout"):
            _check(getattr(self, name) > 0, f"--{name.replace('_', '-')} must be > 0")
        _check(
            not self.retry_after or self.rate is None,
            "--retry-after needs --concurrency or --adaptive (open-loop arrivals do not "
            "wait for answers)",
        )
        if self.adaptive is not None:
            _check(
                self.start_limit <= self.ceiling,
                "--concurrency (the starting limit) must not exceed --max-concurrency",
            )

    @property
    def mode(self) -> Literal["closed", "open", "adaptive"]:
        """Which loop the run is: adaptive (``--adaptive``), open (``--rate``) or closed."""
        if self.adaptive is not None:
            return "adaptive"
        return "open" if self.rate is not None else "closed"

    @property
    def start_limit(self) -> int:
        """Adaptive: the starting limit."""
        return self.concurrency if self.concurrency is not None else 1

    @property
    def ceiling(self) -> int:
        """Adaptive: the largest limit."""
        return self.max_concurrency if self.max_concurrency is not None else 1024


@attrs.frozen(kw_only=True, eq=False)
class RequestRecord:
    """One HTTP attempt. Times are seconds since the run started (``start``, ``end``) or
    since this request started (``ttft``, ``token_times``)."""

    index: int
    """Attempt number, in start order."""
    request: int
    """Logical request number; a 529 retry (adaptive mode) keeps it."""
    attempt: int
    """0 for the first send of a request, 1 for its first retry, …"""
    start: float
    end: float
    status: int | None
    outcome: Outcome
    error_type: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    ttft: float | None = None
    token_times: array[float] = attrs.field(factory=lambda: array("d"))
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    retry_after: float | None = None
    """The answer's ``Retry-After`` in seconds, when it was a 429 / 503 / 529 with one."""
    retry_wait: float = 0.0
    """Seconds the slot stayed taken after this answer for its ``Retry-After`` (Rule 7)."""
    pacing_lag: float | None = None
    """The answer's ``inference-lab-pacing-lag-ms`` in seconds (an inference-lab server:
    how late its engine was when the request reached admission), when it had one."""

    @property
    def e2e(self) -> float:
        """Seconds from the attempt's start to its end."""
        return self.end - self.start


@attrs.frozen(kw_only=True)
class Sample:
    """One time-series point. Counts and latencies cover the ``RATE_WINDOW`` seconds of
    completions up to ``time``."""

    time: float
    limit: int | None
    """The concurrency limit in force (None: unlimited open loop)."""
    in_flight: int
    completed: int
    ok: int
    overloaded: int
    overload_rate: float
    """Fraction of the attempts completed in the window that got 529."""
    e2e_mean: float | None
    ttft_mean: float | None


@attrs.frozen(kw_only=True)
class LoadResult:
    """Everything a run produced; ``report.summarize`` turns it into numbers."""

    config: LoadConfig
    started_at: float
    """Unix time at the start of the run."""
    dispatch_end: float
    """When the run stopped starting requests (seconds since start)."""
    end: float
    """When the last request ended."""
    records: tuple[RequestRecord, ...]
    samples: tuple[Sample, ...]
    limit_changes: tuple[tuple[float, int], ...]
    """Adaptive mode: ``(time, limit)`` at the start and after every change."""
    controller: AIMDStatistics | None
    pool: PoolStatistics
    interrupted: bool


@attrs.define
class Attempt:
    """Mutable state of one attempt while it runs; frozen into a ``RequestRecord``."""

    index: int
    request: int
    attempt: int
    started: float  # trio clock
    ended: float | None = None  # trio clock, when set before _finish
    status: int | None = None
    outcome: Outcome = "cancelled"
    error_type: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    token_times: array[float] = attrs.field(factory=lambda: array("d"))
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    retry_after: float | None = None
    retry_wait: float = 0.0
    pacing_lag: float | None = None
    settled: bool = False  # the controller has seen the outcome (``_Run._settle``)

    def fail(
        self, outcome: Outcome, error_type: str, code: str | None = None, message: str | None = None
    ) -> None:
        self.outcome = outcome
        self.error_type = error_type
        self.error_code = code
        self.error_message = message

    def record(self, t0: float, end: float) -> RequestRecord:
        times = self.token_times
        return RequestRecord(
            index=self.index,
            request=self.request,
            attempt=self.attempt,
            start=self.started - t0,
            end=end - t0,
            status=self.status,
            outcome=self.outcome,
            error_type=self.error_type,
            error_code=self.error_code,
            error_message=self.error_message,
            ttft=times[0] if times else None,
            token_times=times,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            finish_reason=self.finish_reason,
            retry_after=self.retry_after,
            retry_wait=self.retry_wait,
            pacing_lag=self.pacing_lag,
        )


def status_outcome(status: int) -> Outcome:
    if status == 529:
        return "overloaded"
    if status == 503:
        return "unavailable"
    if 400 <= status < 500:
        return "client_error"
    if 500 <= status < 600:
        return "server_error"
    return "http_error"
