"""Inter-token latencies as a streaming client measures them, from the engine's events.

Rule 1: a request's first token opens its stream (that wait is its TTFT); each later
        step that gives it tokens adds one gap, the time since the step that gave it its
        previous token; a step's second and later tokens for it add gaps of 0 (they
        arrive together). A finished request's stream closes. This is what
        ``vllm bench serve`` records as ITL when each token is streamed as it comes.
Rule 2: percentiles are numpy's ``linear`` method over every gap of every request (all
        streams pooled, as vLLM's benchmark pools them); with no gap there are none.
"""

from __future__ import annotations

from array import array

import numpy as np
import numpy.typing as npt

from inference_lab.core.engine import StepEvents

__all__ = ["ItlRecorder"]


class ItlRecorder:
    """Rule 1's gaps, gathered from every :class:`StepEvents` given to :meth:`observe`
    (``run_simulation``'s ``on_events``)."""

    def __init__(self) -> None:
        self.last: dict[int, float] = {}
        self.gaps: array[float] = array("d")

    def observe(self, ev: StepEvents) -> None:
        t = ev.time
        last = self.last
        gaps = self.gaps
        for rid, count in ev.tokens:
            prev = last.get(rid)
            if prev is not None:
                gaps.append(t - prev)
            if count > 1:
                gaps.extend([0.0] * (count - 1))
            last[rid] = t
        for f in ev.finished:
            last.pop(f.request_id, None)

    def percentiles(self, q: npt.NDArray[np.float64]) -> npt.NDArray[np.float64] | None:
        """The gaps' percentiles ``q`` (0-100), seconds; None with no gap (Rule 2)."""
        if not self.gaps:
            return None
        data = np.frombuffer(self.gaps, dtype=np.float64)
        return np.asarray(np.percentile(data, q, method="linear"), dtype=np.float64)

    def median(self) -> float | None:
        """The median gap, seconds; None with no gap."""
        out = self.percentiles(np.array([50.0]))
        return None if out is None else float(out[0])
