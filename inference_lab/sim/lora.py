"""A run's LoRA adapters: the requests each named, the loads into GPU slots, the waits.

Rule 1: pure functions of the engine's statistics at the end of a run (each worker's
        ``LoraStatistics``, summed) and the run's adapter draws.
"""

from __future__ import annotations

from typing import Any

import attrs

from inference_lab.core.engine import EngineStatistics
from inference_lab.workload.adapters import AdapterPicker

__all__ = ["LoraSummary", "lora_summary"]


@attrs.frozen(kw_only=True)
class LoraSummary:
    """The adapters of a run: requests per adapter (``base``: the base model), GPU loads
    (cold: read again after the host cache dropped the adapter), their seconds, and the
    admission passes that skipped a waiting request for ``max_loras`` (its waits)."""

    requests: dict[str, int]
    loads: int
    cold_loads: int
    load_seconds: float
    skips: int

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def lora_summary(stats: EngineStatistics, adapters: AdapterPicker | None) -> LoraSummary | None:
    """The adapters' figures (None: the deployment serves none)."""
    workers = [w.lora for w in stats.workers if w.lora is not None]
    if not workers:
        return None
    return LoraSummary(
        requests={} if adapters is None else adapters.requests_by_adapter(),
        loads=sum(w.loads for w in workers),
        cold_loads=sum(w.cold_loads for w in workers),
        load_seconds=sum(w.load_seconds for w in workers),
        skips=sum(w.skips for w in workers),
    )
