"""What a plan reports: per SLO set, every candidate's figures, ranked; the cheapest; the
Pareto front. The terminal table, CSV, JSON and figure print them (:mod:`.output`).

Rule 1: the figures of a candidate and an SLO set are computed once, from the probe at
        its highest passing rate R (`at_max`), in `rows`; the table, the CSV, the JSON and
        the figure all print those rows, nothing else:
        - goodput = R x (the share of the probe's requests meeting every per-request bound)
          in req/s, and the same requests' output tokens per request x R in tok/s;
        - $/h = price per GPU-hour x GPUs (tp x replicas);
        - $/Mtok = $/h / (goodput tok/s x 3600) x 10^6: the cost of a million output tokens
          served within the SLOs at the highest rate the candidate sustains.
Rule 2: the ranking of a set: candidates with a rate, a price and (when the spec sets
        ``target_rate``) a rate at or above it come first, by $/h then $/Mtok when there is
        a target (the cheapest deployment that carries the traffic) else by $/Mtok, ties by
        higher rate; then the priced ones below the target and the unpriced ones, by rate; then
        those that sustain no rate; then the failures with their reasons. The first of
        the first group is the set's cheapest candidate; there may be none.
Rule 3: the Pareto front of a set is the ranked candidates with a rate and a price that no
        other such candidate beats on both goodput (higher) and $/h (lower).
Rule 4: a row also says why the candidate stops where it does, from the same probe and
        its search: the bounds the lowest failing rate missed (search Rule 4), the mean
        TTFT and queue, and a split's P/D figures (jobs Rule 5: TTFT's four stages, the
        pools' busy shares); :mod:`.compare` sets them side by side.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from inference_lab.plan.jobs import PdFigures
from inference_lab.plan.planner import PlanResult
from inference_lab.plan.search import Miss, good_requests, slo_value_ms
from inference_lab.plan.spec import Candidate, SloSet

__all__ = ["Row", "cheapest", "pareto_front", "rows"]


@attrs.frozen(kw_only=True)
class Row:
    """One candidate under one SLO set (Rule 1). `status`: ``ok`` (a rate), ``none`` (no
    rate down to min_rate), ``failed`` (with `reason`)."""

    rank: int
    slo_set: str
    candidate: Candidate
    status: str
    reason: str
    max_rate: float | None
    capped: bool
    meets_target: bool | None
    goodput_rps: float | None
    goodput_tok_s: float | None
    cost_per_hour: float | None
    usd_per_mtok: float | None
    slo_values_ms: tuple[float | None, ...]  # each SLO of the set at max_rate
    probes: int
    #: Rule 4: the bounds missed at the lowest failing rate (`limit_rate`)
    limit: tuple[Miss, ...] = ()
    limit_rate: float | None = None
    #: Rule 4: at max_rate, the mean TTFT and queue (ms) and a split's P/D figures
    ttft_mean_ms: float | None = None
    queue_mean_ms: float | None = None
    pd: PdFigures | None = None

    @property
    def first_group(self) -> bool:
        return (
            self.status == "ok"
            and self.cost_per_hour is not None
            and self.meets_target is not False
            and bool(self.goodput_tok_s)
        )


def _mean_ms(seconds: Any) -> float | None:
    return float(np.mean(seconds)) * 1e3 if len(seconds) else None


def _row(result: PlanResult, cand: Candidate, slo_set: SloSet) -> Row:
    outcome = (
        None
        if cand.deployment is None
        else result.candidates[cand.index].outcomes.get(slo_set.name)
    )
    target = result.spec.target_rate
    base: dict[str, Any] = {
        "rank": 0,
        "slo_set": slo_set.name,
        "candidate": cand,
        "capped": False,
        "meets_target": None,
        "goodput_rps": None,
        "goodput_tok_s": None,
        "cost_per_hour": cand.cost_per_hour,
        "usd_per_mtok": None,
        "slo_values_ms": tuple(None for _ in slo_set.slos),
        "probes": 0,
        "max_rate": None,
    }
    if outcome is None:
        return Row(status="failed", reason=cand.error or "not searched", **base)
    base["probes"] = len(outcome.probes)
    base["limit"] = outcome.limit
    base["limit_rate"] = outcome.limit_rate
    if outcome.max_rate is None:
        return Row(status="failed", reason=outcome.reason, **base)
    base["max_rate"] = outcome.max_rate
    base["meets_target"] = None if target is None else outcome.max_rate >= target
    probe = outcome.at_max
    if probe is None or outcome.max_rate == 0:
        return Row(status="none", reason=outcome.reason, **base)
    good = good_requests(probe, slo_set)
    rate = outcome.max_rate
    goodput_rps = rate * int(good.sum()) / probe.requests
    goodput_tok = rate * float(probe.latencies.output_tokens[good].sum()) / probe.requests
    cost = cand.cost_per_hour
    base.update(
        capped=outcome.capped,
        goodput_rps=goodput_rps,
        goodput_tok_s=goodput_tok,
        usd_per_mtok=None
        if cost is None or goodput_tok <= 0
        else cost / (goodput_tok * 3600) * 1e6,
        slo_values_ms=tuple(slo_value_ms(probe, s) for s in slo_set.slos),
        ttft_mean_ms=_mean_ms(probe.latencies.ttft),
        queue_mean_ms=_mean_ms(probe.latencies.queue),
        pd=probe.pd,
    )
    reason = "" if cand.price is not None else f"no price for {cand.hardware}"
    if outcome.capped:
        reason = "; ".join(filter(None, [outcome.reason, reason]))
    return Row(status="ok", reason=reason, **base)


def _sort_key(row: Row, has_target: bool) -> tuple[Any, ...]:
    rate = row.max_rate or 0.0
    if row.first_group:
        cost = row.cost_per_hour if has_target else row.usd_per_mtok
        return (0, cost, row.usd_per_mtok, -rate, row.candidate.index)
    if row.status == "ok":
        return (1, 0.0, 0.0, -rate, row.candidate.index)
    if row.status == "none":
        return (2, 0.0, 0.0, 0.0, row.candidate.index)
    return (3, 0.0, 0.0, 0.0, row.candidate.index)


def rows(result: PlanResult) -> dict[str, list[Row]]:
    """Per SLO set (in the spec's order), every candidate's row, ranked (Rule 2)."""
    has_target = result.spec.target_rate is not None
    out: dict[str, list[Row]] = {}
    for slo_set in result.spec.slo_sets:
        unranked = [_row(result, cr.candidate, slo_set) for cr in result.candidates]
        ranked = sorted(unranked, key=lambda r: _sort_key(r, has_target))
        out[slo_set.name] = [attrs.evolve(r, rank=i + 1) for i, r in enumerate(ranked)]
    return out


def cheapest(ranked: Sequence[Row]) -> Row | None:
    """The set's cheapest candidate (Rule 2), or None."""
    return ranked[0] if ranked and ranked[0].first_group else None


def pareto_front(ranked: Sequence[Row]) -> list[Row]:
    """Rule 3, by increasing goodput."""
    points = [r for r in ranked if r.status == "ok" and r.cost_per_hour is not None]
    front = []
    for r in points:
        assert r.goodput_tok_s is not None and r.cost_per_hour is not None
        dominated = any(
            o is not r
            and o.goodput_tok_s is not None
            and o.cost_per_hour is not None
            and o.goodput_tok_s >= r.goodput_tok_s
            and o.cost_per_hour <= r.cost_per_hour
            and (o.goodput_tok_s > r.goodput_tok_s or o.cost_per_hour < r.cost_per_hour)
            for o in points
        )
        if not dominated:
            front.append(r)
    return sorted(front, key=lambda r: (r.goodput_tok_s, r.candidate.index))
