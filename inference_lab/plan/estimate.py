"""How big a plan is before it runs: its candidates, its simulations, its time.

Rule 1: the candidates are counted, never built (spec Rule 4), so the command can say
        how big a spec is, and refuse one past its cap, before it holds anything.
Rule 2: the simulations follow from the search's stopping rule (search Rule 2). A search
        brackets its answer (the start probe and, typically, :data:`BRACKET_PROBES` - 1
        more), then bisects a factor-2 bracket down to ``rel_tol``: ceil(log2(1 /
        rel_tol)) probes. The searches of one candidate (one per SLO set) share the start
        probe. The bound brackets all the way to ``max_rate`` or ``min_rate`` instead.
        Candidates that cannot run cost none: both figures count every candidate, so
        they are over the mark when some cannot run.
Rule 3: the time is the typical count times one probe's wall time (measured: the
        first runnable candidate's start probe, kept in the cache for the plan), over the
        executor's parallelism; a projection, printed as "about".

Who calls this: ``inference_lab.plan.cli`` (the line it prints up front, the cap).
"""

from __future__ import annotations

import math

import attrs

from inference_lab.plan.spec import PlanSpec

__all__ = ["BRACKET_PROBES", "PlanEstimate", "estimate", "format_duration"]

#: Probes a search typically takes to bracket its answer (the start, one on the other
#: side); the shipped plan's searches take 2-3 (docs/planning.md).
BRACKET_PROBES = 2


@attrs.frozen(kw_only=True)
class PlanEstimate:
    """What a plan will cost (the module's Rules)."""

    candidates: int
    slo_sets: int
    simulations: int  # typical (Rule 2)
    at_most: int  # the bound (Rule 2)
    probe_s: float | None  # one probe's wall seconds; None: not measured
    parallelism: int

    @property
    def seconds(self) -> float | None:
        """Rule 3: the projected wall time, or None without a measured probe."""
        if self.probe_s is None:
            return None
        return self.simulations * self.probe_s / max(1, self.parallelism)

    def line(self) -> str:
        """One line for stderr: ``30 candidates x 2 SLO sets: about 300 simulations (at
        most 480) of ~0.52 s each: about 1.3 min on 2 workers``."""
        text = (
            f"{self.candidates:,} candidates x {self.slo_sets} SLO set(s): about "
            f"{self.simulations:,} simulations (at most {self.at_most:,})"
        )
        seconds = self.seconds
        if seconds is None or self.probe_s is None:
            return text + "; no runnable candidate to time"
        workers = "worker" if self.parallelism == 1 else "workers"
        return (
            f"{text} of ~{self.probe_s:.2g} s each: about {format_duration(seconds)} on "
            f"{self.parallelism} {workers}"
        )


def _per_search(spec: PlanSpec) -> tuple[int, int]:
    """(typical, at most) probes of one search after its start probe (Rule 2)."""
    cfg = spec.search
    bisect = max(0, math.ceil(math.log2(1.0 / cfg.rel_tol)))
    start = min(max(spec.start_rate, cfg.min_rate), cfg.max_rate)
    up = math.ceil(math.log2(cfg.max_rate / start)) if cfg.max_rate > start else 0
    down = math.ceil(math.log2(start / cfg.min_rate)) if start > cfg.min_rate else 0
    return BRACKET_PROBES - 1 + bisect, max(up, down) + bisect


def estimate(
    spec: PlanSpec, candidates: int, probe_s: float | None, parallelism: int
) -> PlanEstimate:
    """The estimate of a plan of ``candidates`` (counted by the caller, Rule 1) whose probe
    took ``probe_s`` seconds, on ``parallelism`` workers."""
    typical, bound = _per_search(spec)
    sets = len(spec.slo_sets)
    return PlanEstimate(
        candidates=candidates,
        slo_sets=sets,
        simulations=candidates * (1 + sets * typical),
        at_most=candidates * (1 + sets * bound),
        probe_s=probe_s,
        parallelism=parallelism,
    )


def format_duration(seconds: float) -> str:
    """``45 s``, ``3.2 min``, ``5.1 h``, ``12 days``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:,.0f} days"
