"""What a plan reports: per SLO set, every candidate ranked, the cheapest, the Pareto
front; as a terminal table, CSV and JSON.

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
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import attrs
import numpy as np

from inference_lab.plan.planner import PlanResult
from inference_lab.plan.search import good_requests, slo_value_ms
from inference_lab.plan.spec import Candidate, SloSet

__all__ = [
    "Row",
    "format_report",
    "pareto_front",
    "plan_dict",
    "plot_pareto",
    "rows",
    "write_csv",
]


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

    @property
    def first_group(self) -> bool:
        return (
            self.status == "ok"
            and self.cost_per_hour is not None
            and self.meets_target is not False
            and bool(self.goodput_tok_s)
        )


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


# ---------------------------------------------------------------------------------------
# text


def _num(value: float | None, fmt: str = ",.2f") -> str:
    return "-" if value is None else format(value, fmt)


def _knobs(cand: Candidate) -> str:
    return " ".join(f"{k}={v}" for k, v in cand.knobs) or "-"


def format_report(result: PlanResult, ranked: dict[str, list[Row]], limit: int = 20) -> str:
    """The terminal report: per SLO set its table (the first `limit` rows with a rate), the
    reasons of the candidates that found no rate, and its cheapest candidate; then, once,
    the candidates that cannot run and why."""
    spec = result.spec
    lines: list[str] = []
    for slo_set in spec.slo_sets:
        table_rows = ranked[slo_set.name]
        target = f"; target {spec.target_rate:g} req/s" if spec.target_rate is not None else ""
        lines.append(f"SLO set {slo_set.name}: {slo_set.label}{target}")
        header = [
            "#",
            "model",
            "hw",
            "tp",
            "rep",
            "knobs",
            "GPUs",
            "max req/s",
            "goodput tok/s",
            "$/h",
            "$/Mtok",
            *(f"{s.metric.upper()} p{s.percentile:g}" for s in slo_set.slos),
        ]
        table = [header]
        shown = [r for r in table_rows if r.status == "ok"][:limit]
        for r in shown:
            c = r.candidate
            rate = _num(r.max_rate, ",.2f") + ("+" if r.capped else "")
            if r.meets_target is False:
                rate += " <"
            table.append(
                [
                    str(r.rank),
                    c.model,
                    c.hardware,
                    str(c.tp),
                    str(c.replicas),
                    _knobs(c),
                    str(c.gpus),
                    rate,
                    _num(r.goodput_tok_s, ",.0f"),
                    _num(r.cost_per_hour),
                    _num(r.usd_per_mtok, ",.3f"),
                    *(_num(v, ",.1f") for v in r.slo_values_ms),
                ]
            )
        if len(table) > 1:
            widths = [max(len(row[i]) for row in table) for i in range(len(header))]
            numeric = {0, 3, 4, 6, 7, 8, 9, 10} | set(range(11, len(header)))
            for row in table:
                lines.append(
                    "  ".join(
                        cell.rjust(widths[i]) if i in numeric else cell.ljust(widths[i])
                        for i, cell in enumerate(row)
                    ).rstrip()
                )
        hidden = sum(1 for r in table_rows if r.status == "ok") - len(shown)
        if hidden > 0:
            lines.append(f"... {hidden} more with a rate (plan.csv has every row)")
        if any(r.capped for r in shown):
            lines.append("+ passed at max_rate: the search stopped there")
        if any(r.meets_target is False for r in shown):
            lines.append("< below the target rate")
        for r in table_rows:
            if r.status == "ok" and r.reason and not r.capped:
                lines.append(f"  {r.candidate.label}: {r.reason}")
        for r in table_rows:
            if r.status != "ok" and r.candidate.deployment is not None:
                lines.append(f"  {r.candidate.label}: {r.reason}")
        best = cheapest(table_rows)
        if best is None:
            lines.append(
                f"cheapest for {slo_set.name}: none meets it"
                + (f" at {spec.target_rate:g} req/s" if spec.target_rate is not None else "")
            )
        else:
            lines.append(
                f"cheapest for {slo_set.name}: {best.candidate.label}: {best.candidate.gpus} GPU(s), "
                f"${_num(best.cost_per_hour)}/h, ${_num(best.usd_per_mtok, ',.3f')}/Mtok, up to "
                f"{_num(best.max_rate)} req/s"
            )
        lines.append("")
    misfits = [cr.candidate for cr in result.candidates if cr.candidate.deployment is None]
    if misfits:
        lines.append("cannot run:")
        lines += [f"  {c.label}: {c.error}" for c in misfits]
        lines.append("")
    lines.append(
        f"{len(result.candidates)} candidates, {len(spec.slo_sets)} SLO set(s): "
        f"{result.jobs_run} simulations run, {result.jobs_cached} probes from the cache"
        + (f", {result.jobs_failed} failed" if result.jobs_failed else "")
        + f", {result.wall_s:,.1f} s"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# files


CSV_COLUMNS = (
    "slo_set",
    "rank",
    "model",
    "config",
    "hardware",
    "tp",
    "replicas",
    "knobs",
    "gpus",
    "status",
    "max_rate_rps",
    "capped",
    "meets_target",
    "goodput_rps",
    "goodput_tok_s",
    "usd_per_gpu_hour",
    "usd_per_hour",
    "usd_per_mtok",
    "slo_values_ms",
    "probes",
    "reason",
)


def _candidate_dict(c: Candidate) -> dict[str, Any]:
    return {
        "index": c.index,
        "model": c.model,
        "config": c.config,
        "hardware": c.hardware,
        "tp": c.tp,
        "replicas": c.replicas,
        "knobs": dict(c.knobs),
        "gpus": c.gpus,
        "usd_per_gpu_hour": c.price,
    }


def _row_dict(r: Row, slo_set: SloSet) -> dict[str, Any]:
    return {
        "rank": r.rank,
        "candidate": _candidate_dict(r.candidate),
        "status": r.status,
        "reason": r.reason,
        "max_rate_rps": r.max_rate,
        "capped": r.capped,
        "meets_target": r.meets_target,
        "goodput_rps": r.goodput_rps,
        "goodput_tok_s": r.goodput_tok_s,
        "usd_per_hour": r.cost_per_hour,
        "usd_per_mtok": r.usd_per_mtok,
        "slo_values_ms": {s.label: v for s, v in zip(slo_set.slos, r.slo_values_ms, strict=True)},
        "probes": r.probes,
    }


def plan_dict(result: PlanResult, ranked: dict[str, list[Row]], code: str) -> dict[str, Any]:
    """The JSON document (``plan.json``)."""
    spec = result.spec
    sets = {s.name: s for s in spec.slo_sets}
    return {
        "spec": str(spec.path),
        "code_version": code,
        "workload": str(spec.workload_path),
        "seed": spec.seed,
        "target_rate": spec.target_rate,
        "search": attrs.asdict(spec.search),
        "start_rate": spec.start_rate,
        "prices_usd_per_gpu_hour": dict(spec.prices),
        "slo_sets": {s.name: [slo.label for slo in s.slos] for s in spec.slo_sets},
        "cheapest": {
            name: None if (best := cheapest(rs)) is None else _row_dict(best, sets[name])
            for name, rs in ranked.items()
        },
        "pareto": {
            name: [r.candidate.index for r in pareto_front(rs)] for name, rs in ranked.items()
        },
        "results": {name: [_row_dict(r, sets[name]) for r in rs] for name, rs in ranked.items()},
        "jobs": {
            "run": result.jobs_run,
            "cached": result.jobs_cached,
            "failed": result.jobs_failed,
        },
        "wall_s": result.wall_s,
    }


def write_csv(ranked: dict[str, list[Row]], sets: Sequence[SloSet], out: IO[str]) -> int:
    """One row per candidate and SLO set, ranked within each set; returns the row count."""
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS)
    writer.writeheader()
    count = 0
    for slo_set in sets:
        for r in ranked[slo_set.name]:
            c = r.candidate
            writer.writerow(
                {
                    "slo_set": slo_set.name,
                    "rank": r.rank,
                    "model": c.model,
                    "config": c.config,
                    "hardware": c.hardware,
                    "tp": c.tp,
                    "replicas": c.replicas,
                    "knobs": _knobs(c) if c.knobs else "",
                    "gpus": c.gpus,
                    "status": r.status,
                    "max_rate_rps": "" if r.max_rate is None else r.max_rate,
                    "capped": r.capped,
                    "meets_target": "" if r.meets_target is None else r.meets_target,
                    "goodput_rps": "" if r.goodput_rps is None else r.goodput_rps,
                    "goodput_tok_s": "" if r.goodput_tok_s is None else r.goodput_tok_s,
                    "usd_per_gpu_hour": "" if c.price is None else c.price,
                    "usd_per_hour": "" if r.cost_per_hour is None else r.cost_per_hour,
                    "usd_per_mtok": "" if r.usd_per_mtok is None else r.usd_per_mtok,
                    "slo_values_ms": json.dumps(
                        {s.label: v for s, v in zip(slo_set.slos, r.slo_values_ms, strict=True)}
                    ),
                    "probes": r.probes,
                    "reason": r.reason,
                }
            )
            count += 1
    return count


def plot_pareto(path: Path, result: PlanResult, ranked: dict[str, list[Row]]) -> None:
    """One panel per SLO set: $/h against goodput for every candidate with a rate and a
    price, the Pareto front (Rule 3) joined and labelled. matplotlib's object API with the
    Agg renderer (the ``plan`` extra)."""
    from matplotlib.figure import Figure

    sets = result.spec.slo_sets
    fig = Figure(figsize=(9, 5.5 * len(sets)), layout="constrained")
    axes = np.atleast_1d(fig.subplots(len(sets), 1))
    for ax, slo_set in zip(axes, sets, strict=True):
        rs = [r for r in ranked[slo_set.name] if r.status == "ok" and r.cost_per_hour is not None]
        front = pareto_front(ranked[slo_set.name])
        ax.scatter(
            [r.goodput_tok_s for r in rs],
            [r.cost_per_hour for r in rs],
            s=18,
            color="tab:gray",
            label="candidates",
        )
        if front:
            ax.plot(
                [r.goodput_tok_s for r in front],
                [r.cost_per_hour for r in front],
                marker="o",
                color="tab:blue",
                label="Pareto front",
            )
            for r in front:
                ax.annotate(
                    r.candidate.label,
                    (r.goodput_tok_s or 0.0, r.cost_per_hour or 0.0),
                    fontsize="x-small",
                    xytext=(4, 4),
                    textcoords="offset points",
                )
        best = cheapest(ranked[slo_set.name])
        if best is not None:
            ax.scatter(
                [best.goodput_tok_s],
                [best.cost_per_hour],
                s=90,
                facecolors="none",
                edgecolors="tab:red",
                label="cheapest",
            )
        xs = [r.goodput_tok_s for r in rs if r.goodput_tok_s]
        if xs and max(xs) > 30 * min(xs):  # candidates far apart: a log axis shows them all
            ax.set_xscale("log")
        ax.set_xlabel("goodput at the highest sustainable rate (output tok/s)")
        ax.set_ylabel("cost ($ per hour)")
        ax.set_title(f"{slo_set.name}: {slo_set.label}", fontsize="small")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", fontsize="small")
    fig.savefig(path, format="png", dpi=100)
