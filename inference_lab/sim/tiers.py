"""A run's KV tiers behind HBM: what they held, what was fetched, what was recomputed.

Rule 1: pure functions of the engine's statistics at the end of a run (its tiers' counters,
        summed over workers: ``TierStatistics``) and the prefix cache's own counters.
Rule 2: hit rates are over the prompt tokens the prefix cache was asked for at admissions
        (its ``query_tokens``): HBM's from the prefix cache, the host's and the disk's from
        the tokens fetched from each; a tier's hits that cost more to fetch than to compute
        were recomputed and count apart (``recomputed_tokens``).
"""

from __future__ import annotations

from typing import Any

import attrs

from inference_lab.core.engine import EngineStatistics

__all__ = ["TierSummary", "tier_summary"]


@attrs.frozen(kw_only=True)
class TierSummary:
    """The tiers of a run (Rule 2)."""

    host_capacity_blocks: int
    disk_capacity_blocks: int
    hbm_hit_rate: float
    host_hit_rate: float
    disk_hit_rate: float
    fetches: int
    fetch_bytes: float
    fetch_seconds_mean: float
    recomputed_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def tier_summary(stats: EngineStatistics) -> TierSummary | None:
    """The tiers' figures (None: no tier configured)."""
    tiers = stats.tiers
    if tiers is None:
        return None
    asked = stats.prefix_cache_queries

    def rate(tokens: int) -> float:
        return tokens / asked if asked else 0.0

    return TierSummary(
        host_capacity_blocks=tiers.host_capacity,
        disk_capacity_blocks=tiers.disk_capacity,
        hbm_hit_rate=rate(stats.prefix_cache_hits),
        host_hit_rate=rate(tiers.host_hit_tokens),
        disk_hit_rate=rate(tiers.disk_hit_tokens),
        fetches=tiers.fetches,
        fetch_bytes=tiers.fetch_bytes,
        fetch_seconds_mean=tiers.fetch_seconds / tiers.fetches if tiers.fetches else 0.0,
        recomputed_tokens=tiers.recomputed_tokens,
    )
