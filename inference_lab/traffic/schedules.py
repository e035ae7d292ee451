"""Rate schedules: an open loop's arrival rate as a function of time.

An open loop with a schedule draws its arrivals on a unit-rate clock (a Poisson
process's exponential gaps, or the integers for ``uniform``) and maps each unit time
``u`` to the first time ``t`` whose cumulative rate ``Λ(t) = ∫₀ᵗ λ`` reaches ``u`` (time
rescaling: the result is a non-homogeneous Poisson process of rate ``λ``).

Rule 1: every schedule is a frozen value with validated fields (a workload file's
        ``[rate_schedule]`` table) and a vectorised ``cumulative(t)``; ``arrival_times``
        inverts it by bisection to a relative precision of 1e-12, identically for every
        schedule.
Rule 2: a rate is never negative. ``piecewise`` holds its last rate forever after its
        last point (a last rate of 0 ends the arrivals); ``sine`` is ``mean + amplitude ·
        sin(2π (t + phase) / period)`` with ``amplitude <= mean``; ``square`` is ``high``
        for the first ``duty`` of each period, ``low`` for the rest.
Rule 3: pure numpy; no clock.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from inference_lab.validation import FieldError

__all__ = ["PiecewiseRate", "RateSchedule", "SineRate", "SquareRate", "arrival_times"]

Floats = npt.NDArray[np.float64]


def _nonneg(_inst: Any, attr: attrs.Attribute[Any], value: float) -> None:
    if value < 0:
        raise FieldError(attr.name, f"must be >= 0, got {value!r}")


def _positive(_inst: Any, attr: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise FieldError(attr.name, f"must be > 0, got {value!r}")


@attrs.frozen(kw_only=True)
class PiecewiseRate:
    """Rates at given times (``points``: (seconds, requests/s) pairs, the first at 0,
    times increasing), held until the next point (``step``) or interpolated between
    points (``linear``); the last rate holds after the last point. ``points_file`` (a
    workload file's alternative to ``points``: a CSV of ``time_s,rate`` rows) is read by
    the workload loader into ``points``."""

    type: str = "piecewise"
    points: tuple[tuple[float, float], ...] = ()
    interpolation: str = "step"
    points_file: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.interpolation not in ("step", "linear"):
            raise FieldError(
                "interpolation", f"must be one of step, linear; got {self.interpolation!r}"
            )
        if self.points_file is not None and not self.points:
            return  # the workload loader reads the file into points
        check_points(self.points)

    @property
    def _arrays(self) -> tuple[Floats, Floats]:
        t = np.array([p[0] for p in self.points], dtype=np.float64)
        r = np.array([p[1] for p in self.points], dtype=np.float64)
        return t, r

    def cumulative(self, t: Floats) -> Floats:
        times, rates = self._arrays
        # Λ at each point, then within the segment holding t
        if self.interpolation == "step":
            seg = np.diff(times) * rates[:-1]
        else:
            seg = np.diff(times) * (rates[:-1] + rates[1:]) / 2
        at_point = np.concatenate(([0.0], np.cumsum(seg)))
        i = np.clip(np.searchsorted(times, t, side="right") - 1, 0, len(times) - 1)
        dt = t - times[i]
        if self.interpolation == "step":
            return at_point[i] + rates[i] * dt
        nxt = np.minimum(i + 1, len(times) - 1)
        span = times[nxt] - times[i]
        slope = np.where(span > 0, (rates[nxt] - rates[i]) / np.where(span > 0, span, 1), 0.0)
        return at_point[i] + rates[i] * dt + slope * dt * dt / 2

    def describe(self) -> str:
        rates = [r for _, r in self.points]
        return (
            f"piecewise ({self.interpolation}, {len(self.points)} points) "
            f"{min(rates):g}-{max(rates):g} req/s"
        )

    def total(self) -> float:
        """Λ(∞): finite when the last rate is 0."""
        if self.points[-1][1] > 0:
            return math.inf
        last = np.array([self.points[-1][0]], dtype=np.float64)
        return float(self.cumulative(last)[0])


def check_points(points: tuple[tuple[float, float], ...], where: str = "points") -> None:
    """The rules of a piecewise schedule's points (raised as a FieldError on ``where``)."""
    if not points:
        raise FieldError(where, "needs at least one (time, rate) point")
    if points[0][0] != 0:
        raise FieldError(where, f"the first point must be at time 0, got {points[0][0]!r}")
    for i, (t, r) in enumerate(points):
        if r < 0:
            raise FieldError(where, f"point {i}: rate must be >= 0, got {r!r}")
        if i and not t > points[i - 1][0]:
            raise FieldError(
                where, f"point {i}: times must increase, got {t!r} after {points[i - 1][0]!r}"
            )
    if all(r == 0 for _, r in points):
        raise FieldError(where, "every rate is 0: no request would ever arrive")


@attrs.frozen(kw_only=True)
class SineRate:
    """A diurnal cycle: ``mean + amplitude · sin(2π (t + phase_secs) / period_secs)``."""

    type: str = "sine"
    mean: float = attrs.field(validator=_positive)
    amplitude: float = attrs.field(validator=_nonneg)
    period_secs: float = attrs.field(validator=_positive)
    phase_secs: float = 0.0

    @amplitude.validator
    def _check_amplitude(self, attr: attrs.Attribute[Any], value: float) -> None:
        if value > self.mean:
            raise FieldError(attr.name, f"must be <= mean ({self.mean!r}), got {value!r}")

    def describe(self) -> str:
        return f"sine {self.mean:g} ± {self.amplitude:g} req/s, period {self.period_secs:g} s"

    def cumulative(self, t: Floats) -> Floats:
        w = 2 * math.pi / self.period_secs
        phase = w * self.phase_secs
        result: Floats = self.mean * t + self.amplitude / w * (
            np.cos(phase) - np.cos(w * t + phase)
        )
        return result

    def total(self) -> float:
        return math.inf


@attrs.frozen(kw_only=True)
class SquareRate:
    """``high`` for the first ``duty`` fraction of every period, ``low`` for the rest."""

    type: str = "square"
    low: float = attrs.field(validator=_nonneg)
    high: float = attrs.field(validator=_nonneg)
    period_secs: float = attrs.field(validator=_positive)
    duty: float = 0.5

    def __attrs_post_init__(self) -> None:
        if not 0 < self.duty < 1:
            raise FieldError("duty", f"must be > 0 and < 1, got {self.duty!r}")
        if self.low == 0 and self.high == 0:
            raise FieldError("high", "low and high are both 0: no request would ever arrive")

    def describe(self) -> str:
        return (
            f"square {self.high:g} / {self.low:g} req/s, period {self.period_secs:g} s, "
            f"duty {self.duty:g}"
        )

    def cumulative(self, t: Floats) -> Floats:
        p = self.period_secs
        on = self.duty * p
        per_period = self.high * on + self.low * (p - on)
        k = np.floor(t / p)
        x = t - k * p
        within = np.where(x < on, self.high * x, self.high * on + self.low * (x - on))
        result: Floats = k * per_period + within
        return result

    def total(self) -> float:
        return math.inf


RateSchedule = PiecewiseRate | SineRate | SquareRate


def arrival_times(schedule: RateSchedule, unit: Floats) -> Floats:
    """The times at which the cumulative rate reaches each of ``unit`` (non-decreasing
    unit-rate times): the first ``t`` with ``Λ(t) >= u``; ``inf`` where ``u`` exceeds
    ``Λ(∞)``."""
    out = np.full(unit.shape, np.inf)
    if unit.size == 0:
        return out
    reachable = unit <= schedule.total()
    u = unit[reachable]
    if u.size == 0:
        return out
    lo = np.zeros_like(u)
    hi = np.ones_like(u)
    while True:
        short = schedule.cumulative(hi) < u
        if not short.any():
            break
        hi = np.where(short, hi * 2, hi)
    # bisection: Λ(lo) < u <= Λ(hi), or lo = 0 when u = 0
    for _ in range(200):
        mid = (lo + hi) / 2
        below = schedule.cumulative(mid) < u
        lo = np.where(below, mid, lo)
        hi = np.where(below, hi, mid)
        if np.all(hi - lo <= 1e-12 * np.maximum(hi, 1e-9)):
            break
    hi = np.where(u <= 0, 0.0, hi)
    out[reachable] = hi
    return out
