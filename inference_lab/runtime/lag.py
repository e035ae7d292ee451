"""The pacing-lag meter: how late a runtime's engine task handled its events.

Rule 1: a lag is how long after its due time an event was handled, never negative (the
        caller records an event handled early as 0).
Rule 2: the meter keeps the count, sum and maximum since the runtime started, the last
        :data:`LAG_SAMPLES` lags for percentiles, and the p99 and maximum of the last
        complete window of :data:`LAG_WINDOW` seconds.
Rule 3: a window whose p99 passes :data:`LAG_WARN_P99` logs a warning naming the model,
        at most once per :data:`LAG_WARN_EVERY` seconds.
Rule 4: the meter reads no clock: the caller passes the time.
Rule 5: :attr:`LagMeter.latest` is the largest lag of the latest wake-up of the engine
        task that handled events (the caller sets it once per such wake-up), and
        :meth:`LagMeter.recent_p99` the last complete window's p99 while that window
        ended less than :data:`LAG_WINDOW` ago (0 after a quiet second): the cheap
        "how late now" figures an answer's header and the dashboard read.
"""

from __future__ import annotations

import logging
import math
from collections import deque

import attrs
import numpy as np

__all__ = [
    "LAG_SAMPLES",
    "LAG_WARN_EVERY",
    "LAG_WARN_P99",
    "LAG_WINDOW",
    "LagMeter",
    "LagStatistics",
]

logger = logging.getLogger("inference_lab.serve")

#: Pacing-lag samples kept for percentiles.
LAG_SAMPLES = 65536
#: Seconds of wall-clock over which the pacing lag's p99 is checked.
LAG_WINDOW = 1.0
#: A window whose pacing-lag p99 exceeds this many seconds logs a warning: a few
#: milliseconds are a busy machine's scheduling jitter; beyond that the CPU is not keeping
#: up with the model, and clients see latencies above the model's.
LAG_WARN_P99 = 0.005
#: ... at most once per this many seconds.
LAG_WARN_EVERY = 10.0


@attrs.frozen(kw_only=True)
class LagStatistics:
    """The pacing lag of one runtime (seconds), as :meth:`LagMeter.statistics` saw it."""

    #: Events handled (each one's lag was recorded).
    events: int
    #: The lag summed over every event, its mean and its largest value.
    total: float
    mean: float
    max: float
    #: The median, p99 and largest lag over the requested number of recent events.
    recent_p50: float
    recent_p99: float
    recent_max: float
    #: The p99 and largest lag over the last complete window (:data:`LAG_WINDOW`).
    window_p99: float
    window_max: float


class LagMeter:
    """The pacing lag of one model's runtime (see the module rules). The engine task
    calls :meth:`record` for each event it handles and :meth:`tick` once per wake-up."""

    __slots__ = (
        "count",
        "latest",
        "max",
        "name",
        "total",
        "_last_warning",
        "_samples",
        "_window",
        "_window_max",
        "_window_p99",
        "_window_start",
    )

    def __init__(self, name: str) -> None:
        #: The model's name, for the warning.
        self.name = name
        #: Events recorded, their summed lag and the largest lag (seconds).
        self.count = 0
        self.total = 0.0
        self.max = 0.0
        #: The largest lag of the latest wake-up that handled events (Rule 5).
        self.latest = 0.0
        self._samples: deque[float] = deque(maxlen=LAG_SAMPLES)
        self._window: list[float] = []  # lags of the current window
        self._window_start = 0.0
        self._window_p99 = 0.0  # of the last complete window
        self._window_max = 0.0
        self._last_warning = -math.inf

    @property
    def mean(self) -> float:
        """The mean lag so far (0 before any event)."""
        return self.total / self.count if self.count else 0.0

    def start(self, now: float) -> None:
        """Begin the first window at ``now`` (the runtime's start)."""
        self._window_start = now

    def record(self, lag: float) -> None:
        """Record one event handled ``lag`` (>= 0) seconds late."""
        self.count += 1
        self.total += lag
        if lag > self.max:
            self.max = lag
        self._samples.append(lag)
        self._window.append(lag)

    def tick(self, now: float) -> None:
        """End the current window if it has lasted :data:`LAG_WINDOW` by ``now``."""
        if now - self._window_start >= LAG_WINDOW:
            self._close_window(now)

    def _close_window(self, now: float) -> None:
        """Keep the window's p99 and max for the statistics and warn (Rule 3) when the
        p99 says the CPU is not keeping up with the model."""
        window = sorted(self._window)
        self._window = []
        elapsed = now - self._window_start
        self._window_start = now
        if not window:
            self._window_p99 = self._window_max = 0.0
            return
        p99 = window[min(len(window) - 1, math.ceil(0.99 * len(window)) - 1)]
        self._window_p99, self._window_max = p99, window[-1]
        if p99 > LAG_WARN_P99 and now - self._last_warning >= LAG_WARN_EVERY:
            self._last_warning = now
            logger.warning(
                "%s: pacing lag p99 %.2f ms (max %.2f ms) over the last %.1f s: the CPU is "
                "not keeping up, so clients see latencies above the model's",
                self.name,
                p99 * 1e3,
                window[-1] * 1e3,
                elapsed,
            )

    def recent_p99(self, now: float) -> float:
        """The p99 of the last complete window if it ended less than :data:`LAG_WINDOW`
        before ``now``, else 0 (Rule 5: an engine that handled nothing for a second is
        not late). O(1); read by the dashboard's sampler each tick."""
        return self._window_p99 if now - self._window_start < LAG_WINDOW else 0.0

    def statistics(self, last: int | None = None) -> LagStatistics:
        """The meter's figures; the ``recent_*`` percentiles are over the ``last``
        recorded events (default: every sample kept)."""
        samples = np.fromiter(self._samples, dtype=np.float64)
        if last is not None:
            samples = samples[-last:] if last > 0 else samples[:0]
        p50, p99, high = (
            (
                float(np.percentile(samples, 50)),
                float(np.percentile(samples, 99)),
                float(samples.max()),
            )
            if samples.size
            else (0.0, 0.0, 0.0)
        )
        return LagStatistics(
            events=self.count,
            total=self.total,
            mean=self.mean,
            max=self.max,
            recent_p50=p50,
            recent_p99=p99,
            recent_max=high,
            window_p99=self._window_p99,
            window_max=self._window_max,
        )
