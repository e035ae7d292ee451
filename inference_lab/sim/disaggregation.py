"""A disaggregated run's figures: each pool's load, the transfers, and where TTFT goes.

Rule 1: pure functions of what the engine reported (``Finished`` records with their
        hand-off fields, the engine's statistics); nothing here reads a clock.
Rule 2: a request's TTFT is split, exactly, into four stages that add up to it: the
        prefill queue (arrival to its first scheduling in the prefill pool), the prefill
        (to the end of its last prefill step), the hand-off (the proxy's hop, the wait for
        the decode replica's blocks and the transfer, to the KV's arrival) and the first
        decode step (the wait for a decode slot and the step that computes the rest of the
        prompt and samples the first token).
Rule 3: a pool's busy share is the time its workers spent stepping over the run's span
        (simulated seconds), averaged over its workers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from inference_lab.core.config import Deployment
from inference_lab.core.engine import EngineStatistics
from inference_lab.sim.records import FinishedTable
from inference_lab.sim.summary import LatencyStats

__all__ = ["DisaggregationSummary", "PoolSummary", "disaggregation_summary"]


@attrs.frozen(kw_only=True)
class PoolSummary:
    """One pool: its entry, its GPUs, and how busy its workers were (Rule 3)."""

    role: str
    hardware: str
    replicas: int
    tp: int
    busy_share: float
    requests: int

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen(kw_only=True)
class DisaggregationSummary:
    """The pools, the link and its transfers, and TTFT's four stages (Rule 2)."""

    prefill: PoolSummary
    decode: PoolSummary
    link: str
    streams: int
    transfers: int
    transfer_bytes_mean: float
    transfer_seconds_mean: float
    ttft_queue: LatencyStats
    ttft_prefill: LatencyStats
    ttft_handoff: LatencyStats
    ttft_first_decode: LatencyStats

    def to_dict(self) -> dict[str, Any]:
        out = attrs.asdict(self, recurse=False)
        for key in ("prefill", "decode", "ttft_queue", "ttft_prefill"):
            out[key] = getattr(self, key).to_dict()
        out["ttft_handoff"] = self.ttft_handoff.to_dict()
        out["ttft_first_decode"] = self.ttft_first_decode.to_dict()
        return out


def _pool(
    role: str, dep: Deployment, busy: Sequence[float], span: float, requests: int
) -> PoolSummary:
    share = float(np.mean([b / span for b in busy])) if busy and span > 0 else 0.0
    return PoolSummary(
        role=role,
        hardware=dep.hardware_name,
        replicas=dep.hardware.replicas,
        tp=dep.hardware.tp,
        busy_share=share,
        requests=requests,
    )


def disaggregation_summary(
    dep: Deployment, stats: EngineStatistics, finished: FinishedTable, span: float
) -> DisaggregationSummary:
    """The figures of a disaggregated run on ``dep`` (Rules 1-3); ``span``: the run's
    simulated span (its first arrival to its last completion)."""
    split = dep.disaggregation
    assert split is not None and finished.disaggregated
    first = split.prefill.workers
    busy = [w.busy_seconds for w in stats.workers]
    arrival = finished.column("arrival_time")
    scheduled = finished.column("first_scheduled_time")
    prefilled = finished.column("prefill_end_time")
    arrived = finished.column("transfer_end_time")
    first_token = finished.column("first_token_time")
    done = len(finished)
    return DisaggregationSummary(
        prefill=_pool("prefill", split.prefill, busy[:first], span, done),
        decode=_pool("decode", split.decode, busy[first:], span, done),
        link=split.link_name,
        streams=split.streams,
        transfers=stats.transfers,
        transfer_bytes_mean=stats.transfer_bytes / stats.transfers if stats.transfers else 0.0,
        transfer_seconds_mean=(
            stats.transfer_seconds / stats.transfers if stats.transfers else 0.0
        ),
        ttft_queue=LatencyStats.from_seconds(scheduled - arrival),
        ttft_prefill=LatencyStats.from_seconds(prefilled - scheduled),
        ttft_handoff=LatencyStats.from_seconds(arrived - prefilled),
        ttft_first_decode=LatencyStats.from_seconds(first_token - arrived),
    )
