"""The runtime's two small meters on their own: the pacing-lag meter
(:mod:`inference_lab.runtime.lag`) and the pacer's early wake
(:mod:`inference_lab.runtime.calibration`). Both read no clock, so the times here are
plain numbers; ``test_serve_pacing.py`` covers them inside a running runtime."""

from __future__ import annotations

import logging

import pytest

from inference_lab.runtime.calibration import (
    EARLY_GAIN,
    MAX_EARLY,
    EarlyWake,
    PacingCalibration,
)
from inference_lab.runtime.lag import (
    LAG_SAMPLES,
    LAG_WARN_EVERY,
    LAG_WARN_P99,
    LAG_WINDOW,
    LagMeter,
    LagStatistics,
)


def test_a_fresh_meter_reports_zeros() -> None:
    assert LagMeter("m").statistics() == LagStatistics(
        events=0,
        total=0.0,
        mean=0.0,
        max=0.0,
        recent_p50=0.0,
        recent_p99=0.0,
        recent_max=0.0,
        window_p99=0.0,
        window_max=0.0,
    )


def test_the_meter_counts_sums_and_keeps_the_largest_lag() -> None:
    meter = LagMeter("m")
    for lag in (0.0, 0.004, 0.001, 0.002):
        meter.record(lag)
    st = meter.statistics()
    assert (st.events, st.max) == (4, 0.004)
    assert st.total == pytest.approx(0.007) and st.mean == pytest.approx(0.007 / 4)
    assert (meter.count, meter.max, meter.mean) == (st.events, st.max, st.mean)


def test_recent_percentiles_cover_the_last_events_asked_for() -> None:
    meter = LagMeter("m")
    for lag in [0.010] * 10 + [0.001] * 10:
        meter.record(lag)
    recent = meter.statistics(last=10)
    assert (recent.recent_p50, recent.recent_p99, recent.recent_max) == (0.001, 0.001, 0.001)
    whole = meter.statistics()
    assert whole.recent_max == 0.010 and whole.recent_p50 == pytest.approx(0.0055)
    none = meter.statistics(last=0)
    assert (none.recent_p50, none.recent_p99, none.recent_max) == (0.0, 0.0, 0.0)
    assert none.events == 20  # the totals do not depend on ``last``


def test_only_the_last_lag_samples_are_kept_for_percentiles() -> None:
    meter = LagMeter("m")
    meter.record(1.0)
    for _ in range(LAG_SAMPLES):
        meter.record(0.0)
    st = meter.statistics()
    assert st.recent_max == 0.0  # the early 1 s lag fell out of the samples ...
    assert st.max == 1.0 and st.events == LAG_SAMPLES + 1  # ... but not out of the totals


def test_a_window_closes_after_lag_window_seconds_with_its_p99_and_max() -> None:
    meter = LagMeter("m")
    meter.start(100.0)
    for i in range(100):
        meter.record(i / 1e5)  # 0 .. 0.99 ms
    meter.tick(100.0 + LAG_WINDOW / 2)
    assert meter.statistics().window_max == 0.0  # the window is still open
    meter.tick(100.0 + LAG_WINDOW)
    st = meter.statistics()
    assert (st.window_p99, st.window_max) == (98 / 1e5, 99 / 1e5)
    meter.tick(100.0 + 2 * LAG_WINDOW)  # a window without events
    st = meter.statistics()
    assert (st.window_p99, st.window_max) == (0.0, 0.0)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_window_over_the_threshold_warns_at_most_once_per_lag_warn_every() -> None:
    records = _Records()
    logging.getLogger("inference_lab.serve").addHandler(records)
    try:
        meter = LagMeter("gpt-oss-20b")
        now = 0.0
        meter.start(now)
        windows = int(LAG_WARN_EVERY / LAG_WINDOW) * 2 + 1
        for _ in range(windows):
            meter.record(LAG_WARN_P99 * 2)
            now += LAG_WINDOW
            meter.tick(now)
        meter.record(LAG_WARN_P99)  # at the threshold: no warning
        meter.tick(now + LAG_WARN_EVERY)
    finally:
        logging.getLogger("inference_lab.serve").removeHandler(records)
    assert len(records.messages) == 3  # windows 1, 11 and 21
    assert records.messages[0].startswith("gpt-oss-20b: pacing lag p99 10.00 ms (max 10.00 ms)")


def test_the_first_wake_ups_move_the_early_wake_by_one_over_their_count() -> None:
    """Each sample is how late a wake-up found its step after waking early: the k-th of
    the first ones moves the early wake by 1/k of it."""
    wake = EarlyWake()
    for lateness in (0.00005, 0.0001, 0.00015):
        wake.learn(lateness)
    expected = 0.00005 + 0.0001 / 2 + 0.00015 / 3
    assert wake.statistics() == PacingCalibration(pytest.approx(expected), 3)


def test_later_wake_ups_move_the_early_wake_by_the_gain() -> None:
    wake = EarlyWake()
    first = round(1 / EARLY_GAIN)
    for _ in range(first):
        wake.learn(0.00001)
    before = wake.early
    assert before < MAX_EARLY
    wake.learn(0.0002)
    assert wake.early == pytest.approx(before + EARLY_GAIN * 0.0002)
    wake.learn(-0.0001)  # woke too early: the early wake shrinks
    assert wake.early == pytest.approx(before + EARLY_GAIN * 0.0001)
    assert wake.samples == first + 2


def test_the_early_wake_stays_within_zero_and_max_early() -> None:
    wake = EarlyWake()
    wake.learn(1.0)
    assert wake.early == MAX_EARLY
    wake.learn(-1.0)  # a wake-up that found its step a second early
    assert wake.early == 0.0
    assert wake.samples == 2


def test_an_adopted_calibration_is_kept_within_bounds_and_learning_goes_on() -> None:
    wake = EarlyWake()
    wake.adopt(PacingCalibration(1.0, 3))
    assert wake.statistics() == PacingCalibration(MAX_EARLY, 3)
    wake.adopt(PacingCalibration(-1.0, -2))
    assert wake.statistics() == PacingCalibration(0.0, 0)
    wake.adopt(PacingCalibration(0.0001, 100))
    wake.learn(0.0001)
    assert wake.statistics() == PacingCalibration(pytest.approx(0.0001 + EARLY_GAIN * 0.0001), 101)
