"""What a plan prints and writes: the terminal report, ``plan.csv``, ``plan.json`` and
``pareto.png``, all from the rows of :mod:`.report` (its Rule 1) and the comparisons of
:mod:`.compare`.

Rule 1: nothing here computes a figure; each output prints the rows' own.
Rule 2: a plan without splits prints the table it always did; with splits (``spec
        disaggregation``) the table gains a ``P/D`` column (the split, ``-`` for
        aggregated) and a ``limit`` column (the bounds a higher rate breaks first), and
        each SLO set's section ends with the P/D-against-aggregated comparison. The CSV's
        and the JSON's fields are the same for every plan.

Who calls this: ``inference_lab.plan.cli``.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import attrs
import numpy as np

from inference_lab.plan.compare import (
    comparisons,
    format_comparisons,
    limit_label,
    limit_text,
    ttft_stages,
)
from inference_lab.plan.planner import PlanResult
from inference_lab.plan.report import Row, cheapest, pareto_front
from inference_lab.plan.spec import Candidate, PlanSpec, SloSet

__all__ = ["CSV_COLUMNS", "format_report", "plan_dict", "plot_pareto", "write_csv"]


# ---------------------------------------------------------------------------------------
# text


def _num(value: float | None, fmt: str = ",.2f") -> str:
    return "-" if value is None else format(value, fmt)


def _knobs(cand: Candidate) -> str:
    return " ".join(f"{k}={v}" for k, v in cand.knobs) or "-"


def _table(slo_set: SloSet, shown: Sequence[Row], split: bool) -> list[str]:
    """The set's table of `shown` rows, aligned (Rule 2: `split` adds P/D and limit)."""
    header = ["#", "model", "hw", "tp", "rep"]
    header += ["P/D"] if split else []
    header += ["knobs", "GPUs", "max req/s", "goodput tok/s", "$/h", "$/Mtok"]
    header += [f"{s.metric.upper()} p{s.percentile:g}" for s in slo_set.slos]
    header += ["limit"] if split else []
    table = [header]
    for r in shown:
        c = r.candidate
        rate = _num(r.max_rate, ",.2f") + ("+" if r.capped else "")
        if r.meets_target is False:
            rate += " <"
        cells = [str(r.rank), c.model, c.hardware, str(c.tp), str(c.replicas)]
        cells += [c.split.name if c.split is not None else "-"] if split else []
        cells += [_knobs(c), str(c.gpus), rate, _num(r.goodput_tok_s, ",.0f")]
        cells += [_num(r.cost_per_hour), _num(r.usd_per_mtok, ",.3f")]
        cells += [_num(v, ",.1f") for v in r.slo_values_ms]
        cells += [limit_label(r)] if split else []
        table.append(cells)
    if len(table) == 1:
        return []
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    left = {"model", "hw", "knobs", "P/D", "limit"}
    return [
        "  ".join(
            cell.ljust(widths[i]) if header[i] in left else cell.rjust(widths[i])
            for i, cell in enumerate(row)
        ).rstrip()
        for row in table
    ]


def _section(spec: PlanSpec, slo_set: SloSet, table_rows: Sequence[Row], limit: int) -> list[str]:
    """One SLO set: its table (the first `limit` rows with a rate), the notes, the reasons
    of the candidates that found no rate, the comparison (with splits), the cheapest."""
    target = f"; target {spec.target_rate:g} req/s" if spec.target_rate is not None else ""
    lines = [f"SLO set {slo_set.name}: {slo_set.label}{target}"]
    shown = [r for r in table_rows if r.status == "ok"][:limit]
    lines += _table(slo_set, shown, bool(spec.disaggregation))
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
    lines += format_comparisons(table_rows)
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
    return lines


def format_report(result: PlanResult, ranked: dict[str, list[Row]], limit: int = 20) -> str:
    """The terminal report: per SLO set its section (:func:`_section`); then, once, the
    candidates that cannot run and why, and the plan's counts."""
    spec = result.spec
    lines: list[str] = []
    for slo_set in spec.slo_sets:
        lines += _section(spec, slo_set, ranked[slo_set.name], limit)
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
    "layout",
    "prefill_replicas",
    "decode_replicas",
    "limit",
    "limit_rate_rps",
    "ttft_stages_ms",
    "pd",
)


def _split_fields(c: Candidate) -> dict[str, Any]:
    """The candidate's layout: ``aggregated`` (pools of 0) or its split."""
    return {
        "layout": c.layout,
        "prefill_replicas": 0 if c.split is None else c.split.prefill,
        "decode_replicas": 0 if c.split is None else c.split.decode,
    }


def _why_fields(r: Row) -> dict[str, Any]:
    """Why the row stops where it does (report Rule 4), for the CSV and the JSON."""
    return {
        "limit": limit_text(r) if r.limit or r.capped else "",
        "limit_rate_rps": r.limit_rate,
        "ttft_stages_ms": dict(ttft_stages(r)),
        "pd": None if r.pd is None else attrs.asdict(r.pd),
    }


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
        **_split_fields(c),
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
        **_why_fields(r),
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
        "disaggregation": [split.name for split in spec.disaggregation],
        "gpu_budget": spec.gpu_budget,
        "cheapest": {
            name: None if (best := cheapest(rs)) is None else _row_dict(best, sets[name])
            for name, rs in ranked.items()
        },
        "pareto": {
            name: [r.candidate.index for r in pareto_front(rs)] for name, rs in ranked.items()
        },
        "results": {name: [_row_dict(r, sets[name]) for r in rs] for name, rs in ranked.items()},
        "comparisons": {
            name: [
                {
                    "shape": g.shape,
                    "gpus": g.gpus,
                    "verdict": g.verdict,
                    "winner": None if g.winner is None else g.winner.candidate.index,
                    "ranking": [m.candidate.index for m in g.members],
                }
                for g in comparisons(rs)
            ]
            for name, rs in ranked.items()
        },
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
                    **_split_fields(c),
                    **{
                        k: "" if v is None else json.dumps(v) if isinstance(v, dict) else v
                        for k, v in _why_fields(r).items()
                    },
                }
            )
            count += 1
    return count


def plot_pareto(path: Path, result: PlanResult, ranked: dict[str, list[Row]]) -> None:
    """One panel per SLO set: $/h against goodput for every candidate with a rate and a
    price (the splits as triangles), the Pareto front (report Rule 3) joined and labelled.
    matplotlib's object API with the Agg renderer (the ``plan`` extra)."""
    from matplotlib.figure import Figure

    sets = result.spec.slo_sets
    fig = Figure(figsize=(9, 5.5 * len(sets)), layout="constrained")
    axes = np.atleast_1d(fig.subplots(len(sets), 1))
    for ax, slo_set in zip(axes, sets, strict=True):
        rs = [r for r in ranked[slo_set.name] if r.status == "ok" and r.cost_per_hour is not None]
        front = pareto_front(ranked[slo_set.name])
        for kind, members, marker, colour in (
            ("aggregated", [r for r in rs if r.candidate.split is None], "o", "tab:gray"),
            ("P/D splits", [r for r in rs if r.candidate.split is not None], "^", "tab:orange"),
        ):
            if members or kind == "aggregated":
                ax.scatter(
                    [r.goodput_tok_s for r in members],
                    [r.cost_per_hour for r in members],
                    s=18 if marker == "o" else 30,
                    marker=marker,
                    color=colour,
                    label="candidates" if not result.spec.disaggregation else kind,
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
        ax.legend(loc="best", fontsize="small")
    fig.savefig(path, format="png", dpi=100)
