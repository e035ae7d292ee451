"""P/D against aggregated: the candidates of one shape side by side, and why one wins.

Rule 1: a group is the candidates of one model config, hardware, tp, scheduler settings
        and GPU count: the aggregated replicas and the prefill/decode splits of as many
        GPUs, at one price. Only groups holding a split are compared, in the spec's order
        of their first candidate.
Rule 2: a group's members rank by their highest passing rate (ties: goodput, then the
        spec's order), the members without a rate last; the first is the group's winner
        when its rate is above 0, and the verdict names it against the best member of the
        other kind (``2P1D beats 3 aggregated replicas (4.06 against 3.00 req/s)``); two
        kinds at one rate tie.
Rule 3: a member's reason is its row's (report Rule 4), at its own highest passing rate:
        the bound a higher rate breaks first and at which rate, where its mean TTFT goes
        (aggregated: the queue, then its prefill and first token; a split: ``sim``'s four
        stages, which add up to its mean TTFT) and, for a split, the pools' busy shares
        and its mean transfer.

Who calls this: :mod:`inference_lab.plan.output` (the terminal section, the JSON).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from inference_lab.plan.report import Row

__all__ = [
    "Comparison",
    "comparisons",
    "format_comparisons",
    "limit_label",
    "limit_text",
    "reason",
    "ttft_stages",
]


@attrs.frozen(kw_only=True)
class Comparison:
    """One group of Rule 1, its members ranked (Rule 2), and its verdict in a sentence."""

    shape: str  # "Llama-3.3-70B-Instruct-FP8 on 3 x h200 (tp 1)"
    gpus: int
    members: tuple[Row, ...]
    winner: Row | None
    verdict: str


def ttft_stages(row: Row) -> tuple[tuple[str, float], ...]:
    """Where the row's mean TTFT goes, in ms (Rule 3); empty without a rate."""
    pd = row.pd
    if pd is not None:
        return (
            ("queue", pd.queue_ms),
            ("prefill", pd.prefill_ms),
            ("hand-off", pd.handoff_ms),
            ("first decode", pd.first_decode_ms),
        )
    if row.ttft_mean_ms is None or row.queue_mean_ms is None:
        return ()
    return (
        ("queue", row.queue_mean_ms),
        ("prefill and first token", row.ttft_mean_ms - row.queue_mean_ms),
    )


def limit_label(row: Row) -> str:
    """The table's ``limit`` cell: the bounds a higher rate breaks first (``TTFT p99``),
    ``max_rate`` when the search stopped there, ``-`` when nothing failed."""
    if row.capped:
        return "max_rate"
    return ", ".join(m.label for m in row.limit) or "-"


def limit_text(row: Row) -> str:
    """``TTFT p99 2,130.5 ms at 4.31 req/s``: the bounds missed at the lowest failing rate."""
    if row.capped:
        return "none up to max_rate"
    if not row.limit or row.limit_rate is None:
        return "-"
    return ", ".join(m.text for m in row.limit) + f" at {row.limit_rate:,.4g} req/s"


def reason(row: Row) -> str:
    """Rule 3 in one line: the limit, the TTFT stages, a split's busy pools and its mean
    transfer (the part of the hand-off spent on the link; the rest waits for the proxy's
    hop and the decode replica's blocks)."""
    parts = [f"limit {limit_text(row)}"]
    stages = ttft_stages(row)
    if stages:
        parts.append("TTFT " + " + ".join(f"{v:,.1f} {k}" for k, v in stages) + " (ms)")
    pd = row.pd
    if pd is not None:
        parts.append(f"busy prefill {pd.prefill_busy:.0%}, decode {pd.decode_busy:.0%}")
        parts.append(f"transfer {pd.transfer_s * 1e3:,.1f} ms of {pd.transfer_bytes / 1e9:,.2f} GB")
    return "; ".join(parts)


def _key(row: Row) -> tuple[Any, ...]:
    c = row.candidate
    return (c.config, c.hardware, c.tp, c.knobs, c.gpus)


def _rank(row: Row) -> tuple[Any, ...]:
    rate = row.max_rate if row.status == "ok" and row.max_rate else 0.0
    return (-rate, -(row.goodput_tok_s or 0.0), row.candidate.index)


def _name(row: Row) -> str:
    c = row.candidate
    return f"{c.replicas} aggregated replicas" if c.split is None else c.split.name


def _short(row: Row) -> str:
    c = row.candidate
    return f"x{c.replicas}" if c.split is None else c.split.name


def _rate(row: Row) -> str:
    return f"{row.max_rate or 0.0:,.2f}" + ("+" if row.capped else "")


def _verdict(members: Sequence[Row]) -> tuple[Row | None, str]:
    """Rule 2's winner and sentence."""
    best = members[0]
    if best.status != "ok" or not best.max_rate:
        return None, "none of them meets the SLOs"
    others = [m for m in members if (m.candidate.split is None) != (best.candidate.split is None)]
    rival = others[0] if others else None
    if rival is None:
        kind = "split" if best.candidate.split is None else "aggregated candidate"
        return best, f"{_name(best)} carries {_rate(best)} req/s (no {kind} of these GPUs)"
    if rival.status != "ok" or not rival.max_rate:
        verb = "meet" if rival.candidate.split is None else "meets"
        return best, f"{_name(best)} carries {_rate(best)} req/s; {_name(rival)} {verb} no rate"
    if rival.max_rate == best.max_rate:
        return best, f"{_name(best)} and {_name(rival)} tie at {_rate(best)} req/s"
    verb = "beat" if best.candidate.split is None else "beats"
    return best, f"{_name(best)} {verb} {_name(rival)} ({_rate(best)} against {_rate(rival)} req/s)"


def comparisons(ranked: Sequence[Row]) -> list[Comparison]:
    """The groups of one SLO set's rows (Rule 1), each ranked with its verdict (Rule 2)."""
    groups: dict[tuple[Any, ...], list[Row]] = {}
    for row in sorted(ranked, key=lambda r: r.candidate.index):
        groups.setdefault(_key(row), []).append(row)
    out = []
    for members in groups.values():
        if not any(m.candidate.split is not None for m in members):
            continue
        members.sort(key=_rank)
        c = members[0].candidate
        knobs = "".join(f", {k}={v}" for k, v in c.knobs)
        winner, verdict = _verdict(members)
        out.append(
            Comparison(
                shape=f"{c.model} on {c.gpus} x {c.hardware} (tp {c.tp}{knobs})",
                gpus=c.gpus,
                members=tuple(members),
                winner=winner,
                verdict=verdict,
            )
        )
    return out


def format_comparisons(ranked: Sequence[Row]) -> list[str]:
    """The terminal section of one SLO set: per group its verdict, then each member's rate,
    its rate against the winner's, and its reason (Rule 3). Empty without a split."""
    groups = comparisons(ranked)
    if not groups:
        return []
    lines = [
        "P/D against aggregated at the same GPUs (each at its highest passing rate: the "
        "bound a higher rate breaks first; mean TTFT by stage; a split's busy pools):"
    ]
    for group in groups:
        lines.append(f"  {group.shape}: {group.verdict}")
        width = max(len(_short(m)) for m in group.members)
        top = group.winner.max_rate if group.winner is not None else None
        for m in group.members:
            name = _short(m).ljust(width)
            if m.status != "ok":
                lines.append(f"    {name}  no rate: {m.reason}")
                continue
            versus = ""
            if top and m is not group.winner:
                versus = f" ({(m.max_rate or 0.0) / top - 1:+.0%})"
            lines.append(f"    {name}  {_rate(m)} req/s{versus}; {reason(m)}")
    return lines
