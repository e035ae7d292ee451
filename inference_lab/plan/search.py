"""The rate search: the highest open-loop rate at which a candidate meets an SLO set.

Rule 1: a search is a synchronous state machine: `next_rate` is the probe it wants, `feed`
        takes that probe's result; it never runs anything, so the planner can interleave
        many searches over any backend, and the answer depends only on the results fed,
        never on the order in which other searches' results arrive.
Rule 2: the stopping rule (docs/planning.md): from the start rate, double while the
        probe passes (halve while it fails) until one rate passes and another fails, then
        bisect at the midpoint until ``fail - pass <= rel_tol * pass``. The answer is the
        highest rate that passed. Passing at ``max_rate`` ends the search there (capped);
        failing at ``min_rate`` ends it with no sustainable rate. Rates are rounded to 6
        significant digits, so a search repeated gives the same probes and the same keys.
Rule 3: a probe passes when it ran (no error), refused at most ``max_refused`` of its
        requests, completed at least one, and every SLO's percentile (over the completed
        requests, or over all inter-token gaps for ITL) is within its bound. An error or
        too many refusals ends the search as a failure with that one-line reason: neither
        depends on the rate.
Rule 4: a finished search says what limits the candidate: the SLOs missed by the probe
        at the lowest failing rate (`SearchOutcome.limit`, at `limit_rate`), the bound
        that a higher rate breaks first.
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt

from inference_lab.plan.jobs import ProbeResult
from inference_lab.plan.spec import SearchConfig, Slo, SloSet

__all__ = [
    "Miss",
    "RateSearch",
    "SearchOutcome",
    "good_requests",
    "misses",
    "slo_value_ms",
    "verdict",
]


def _round(rate: float) -> float:
    return float(f"{rate:.6g}")


def slo_value_ms(result: ProbeResult, slo: Slo) -> float | None:
    """The probe's `slo.percentile` of `slo.metric` in ms (None: no sample)."""
    if slo.metric == "itl":
        index = int(round(slo.percentile * 10))  # the grid of jobs.ITL_PERCENTILES
        value = float(result.itl[index])
        return None if np.isnan(value) else value * 1e3
    samples = getattr(result.latencies, slo.metric)
    samples = samples[~np.isnan(samples)]
    if samples.size == 0:
        return None
    return float(np.percentile(samples, slo.percentile, method="linear")) * 1e3


@attrs.frozen
class Miss:
    """A bound a probe missed: ``TTFT p99`` and the probe's value (ms), or a probe in which
    no request completed (``value_ms`` None)."""

    label: str
    value_ms: float | None

    @property
    def text(self) -> str:
        return self.label if self.value_ms is None else f"{self.label} {self.value_ms:,.1f} ms"


def misses(result: ProbeResult, slo_set: SloSet) -> tuple[Miss, ...]:
    """The bounds of the set the probe's completed requests miss, in the set's order (a
    probe that completed none misses them all, as one `Miss`)."""
    if result.completed == 0:
        return (Miss("no request completed", None),)
    found = []
    for slo in slo_set.slos:
        value = slo_value_ms(result, slo)
        if value is not None and value > slo.max_ms:
            found.append(Miss(f"{slo.metric.upper()} p{slo.percentile:g}", value))
    return tuple(found)


def verdict(result: ProbeResult, slo_set: SloSet, search: SearchConfig) -> tuple[bool, str]:
    """Whether the probe passes (Rule 3) and, when it does not, why (one line)."""
    if result.error:
        return False, result.error
    if result.refused > search.max_refused * result.requests:
        return False, f"{result.refused} of {result.requests} requests refused: {result.refusal}"
    if result.completed == 0:
        return False, "no request completed"
    found = misses(result, slo_set)
    if found:
        return False, "over the bound: " + ", ".join(m.text for m in found)
    return True, ""


def good_requests(result: ProbeResult, slo_set: SloSet) -> npt.NDArray[np.bool_]:
    """Which completed requests meet every per-request bound of the set (TTFT, TPOT, E2E,
    queue; a request with one token has no TPOT and meets a TPOT bound). ITL bounds are on
    the distribution of gaps, not on requests, so they classify no request."""
    lat = result.latencies
    good = np.ones(lat.ttft.size, dtype=bool)
    for slo in slo_set.slos:
        if slo.metric == "itl":
            continue
        samples = getattr(lat, slo.metric)
        good &= ~(samples * 1e3 > slo.max_ms)  # NaN (no TPOT) compares False: good
    return good


@attrs.frozen(kw_only=True)
class SearchOutcome:
    """A finished search. `max_rate` is None when the candidate failed (`reason`), 0.0 when
    no rate down to `min_rate` passed; `at_max` is the probe at `max_rate`."""

    max_rate: float | None
    capped: bool
    reason: str
    probes: tuple[tuple[float, bool], ...]  # (rate, passed) in the order probed
    at_max: ProbeResult | None
    #: Rule 4: the bounds missed at the lowest failing rate (empty: no rate failed)
    limit: tuple[Miss, ...] = ()
    limit_rate: float | None = None


class RateSearch:
    """The state machine of Rule 1 for one candidate and one SLO set."""

    def __init__(self, slo_set: SloSet, search: SearchConfig, start_rate: float) -> None:
        self.slo_set = slo_set
        self.search = search
        self.next_rate: float | None = _round(
            min(max(start_rate, search.min_rate), search.max_rate)
        )
        self.outcome: SearchOutcome | None = None
        self._pass: ProbeResult | None = None  # the highest rate that passed
        self._fail: float | None = None  # the lowest rate that failed
        self._limit: tuple[Miss, ...] = ()  # what it missed (Rule 4)
        self._probes: list[tuple[float, bool]] = []

    @property
    def done(self) -> bool:
        return self.outcome is not None

    def _finish(self, reason: str = "", failed: bool = False, capped: bool = False) -> None:
        best = self._pass
        self.outcome = SearchOutcome(
            max_rate=None if failed else (best.rate if best is not None else 0.0),
            capped=capped,
            reason=reason,
            probes=tuple(self._probes),
            at_max=best,
            limit=self._limit,
            limit_rate=self._fail,
        )
        self.next_rate = None

    def fail(self, reason: str) -> None:
        """End the search as a failure the probes cannot cure (a job that kept killing its
        worker, an internal error)."""
        self._finish(reason, failed=True)

    def feed(self, result: ProbeResult) -> None:
        """Take the result of the probe at `next_rate` and choose the next (Rule 2)."""
        rate = result.rate
        passed, why = verdict(result, self.slo_set, self.search)
        self._probes.append((rate, passed))
        if not passed and (
            result.error or result.refused > self.search.max_refused * result.requests
        ):
            self._finish(why, failed=True)
            return
        if passed:
            if self._pass is None or rate > self._pass.rate:
                self._pass = result
        elif self._fail is None or rate < self._fail:
            self._fail = rate
            self._limit = misses(result, self.slo_set)
        cfg = self.search
        lo = self._pass.rate if self._pass is not None else None
        hi = self._fail
        if hi is None:  # only passes so far: double
            assert lo is not None
            if lo >= cfg.max_rate:
                self._finish(f"meets the SLOs at max_rate {cfg.max_rate:g}", capped=True)
            else:
                self.next_rate = _round(min(lo * 2, cfg.max_rate))
        elif lo is None:  # only failures so far: halve
            if hi <= cfg.min_rate:
                self._finish(f"misses the SLOs at min_rate {cfg.min_rate:g} ({why})")
            else:
                self.next_rate = _round(max(hi / 2, cfg.min_rate))
        elif hi - lo <= cfg.rel_tol * lo:
            self._finish()
        else:
            mid = _round((lo + hi) / 2)
            if mid <= lo or mid >= hi:  # the rounding cannot split them further
                self._finish()
            else:
                self.next_rate = mid
