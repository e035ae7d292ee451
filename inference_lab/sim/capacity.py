"""Whether an open-loop simulation asked more of the deployment than it can serve.

A closed loop cannot overload a deployment (each user waits for its answer), and an open
loop within capacity serves requests as fast as they arrive. An open loop beyond capacity
serves them at the deployment's own rate while the rest pile up in the waiting queue (or,
with ``max_waiting``, are refused): its latencies then grow with the run's length and
describe the run, not the deployment. ``sim`` says so in one line under its table.

Rule 1: the verdict looks at the second half of the arrival window, ``(mid, last]`` with
        ``mid`` halfway between the first and the last arrival: by then a deployment that
        keeps up completes requests as fast as they arrive, whatever their latency.
Rule 2: "over capacity" needs both signs: requests completed in that half at a rate more
        than :data:`MARGIN` below the rate they arrived at, and a backlog that grew (the
        waiting queue right after the last arrival is longer than right after the last
        arrival at or before ``mid``), or arrivals of that half refused by
        ``max_waiting``. A run that keeps up shows neither, noise included.
Rule 3: no verdict (None) for a closed loop, for arrivals all at one instant (``batched``)
        and for a second half with fewer than :data:`MIN_ARRIVALS` arrivals: there is no
        rate to compare.
Rule 4: pure: a function of the arrival and completion times and two queue lengths the
        simulation loop recorded; nothing here reads a clock or touches the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

__all__ = ["MARGIN", "MIN_ARRIVALS", "CapacityVerdict", "assess_capacity", "judge_capacity"]

#: Served slower than offered by more than this fraction (Rule 2).
MARGIN = 0.1
#: Arrivals the second half of the window needs for a verdict (Rule 3).
MIN_ARRIVALS = 20


@attrs.frozen(kw_only=True)
class CapacityVerdict:
    """The comparison of Rule 2 over the window ``(mid, last]`` (simulated seconds)."""

    over: bool
    window_start_s: float
    window_end_s: float
    offered_rps: float
    """Arrivals in the window per second (those refused by ``max_waiting`` included)."""
    served_rps: float
    """Completions in the window per second."""
    waiting_at_mid: int
    waiting_at_end: int
    rejected: int
    """Arrivals in the window refused by ``max_waiting``."""

    def message(self) -> str | None:
        """The line ``sim`` prints under its table when the run was over capacity."""
        if not self.over:
            return None
        rates = (
            f"over capacity: requests arrived at {self.offered_rps:,.2f}/s and completed at "
            f"{self.served_rps:,.2f}/s over the second half of the arrivals "
            f"({self.window_start_s:,.1f}-{self.window_end_s:,.1f} s)"
        )
        if self.waiting_at_end > self.waiting_at_mid:
            rates += (
                f" while the waiting queue grew from {self.waiting_at_mid:,} to "
                f"{self.waiting_at_end:,}"
            )
        if self.rejected:
            return f"{rates}; max_waiting refused {self.rejected:,} of those arrivals"
        return f"{rates}; these latencies grow with the run's length"

    def to_dict(self) -> dict[str, Any]:
        """The ``capacity`` section of ``sim -o``'s JSON (with the printed line, or null)."""
        return {**attrs.asdict(self), "message": self.message()}


def assess_capacity(
    arrivals: Sequence[float] | npt.NDArray[np.float64],
    completions: Sequence[float] | npt.NDArray[np.float64],
    *,
    rejected: Sequence[float] = (),
    waiting_at_mid: int,
    waiting_at_end: int,
) -> CapacityVerdict | None:
    """The verdict of Rules 1-3 for an open-loop run. ``arrivals``: the time of every
    arrival the deployment could have run (those ``max_waiting`` refused included, those
    that never fit left out); ``completions``: every finish time; ``rejected``: the
    arrival times refused by ``max_waiting``; the two queue lengths as the loop recorded
    them (right after the last arrival at or before the window's middle, and right after
    the last arrival). Called by :func:`inference_lab.sim.run.run_simulation`."""
    if not len(arrivals):
        return None
    times = np.asarray(arrivals, dtype=np.float64)  # (the simulator's arrays as they are)
    first, last = float(times.min()), float(times.max())
    mid = (first + last) / 2
    offered = int(np.count_nonzero((times > mid) & (times <= last)))
    done = np.asarray(completions, dtype=np.float64)
    served = int(np.count_nonzero((done > mid) & (done <= last)))
    return judge_capacity(
        first,
        last,
        offered=offered,
        served=served,
        rejected=sum(1 for t in rejected if mid < t <= last),
        waiting_at_mid=waiting_at_mid,
        waiting_at_end=waiting_at_end,
    )


def judge_capacity(
    first: float,
    last: float,
    *,
    offered: int,
    served: int,
    rejected: int,
    waiting_at_mid: int,
    waiting_at_end: int,
) -> CapacityVerdict | None:
    """The verdict of Rules 1-3 from counts: the first and the last arrival time, and over
    ``(mid, last]`` (``mid = (first + last) / 2``) the arrivals ``offered``, the
    completions ``served`` and the arrivals ``rejected`` by ``max_waiting``. For
    :func:`assess_capacity` and for a sharded run, whose shards count their own
    arrivals and completions in the window."""
    mid = (first + last) / 2
    span = last - mid
    if span <= 0 or offered < MIN_ARRIVALS:
        return None
    slower = served < (1 - MARGIN) * offered
    backlog = waiting_at_end > waiting_at_mid or rejected > 0
    return CapacityVerdict(
        over=slower and backlog,
        window_start_s=mid,
        window_end_s=last,
        offered_rps=offered / span,
        served_rps=served / span,
        waiting_at_mid=waiting_at_mid,
        waiting_at_end=waiting_at_end,
        rejected=rejected,
    )
