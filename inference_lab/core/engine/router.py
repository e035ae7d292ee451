"""Which replica an arrival goes to: the deployment's ``router``.

Rule 1: a deployment of one worker never asks the router (its answer is that worker).
Rule 2: the router reads the workers' load (requests running + waiting, plus the requests
        the serving layer routed there that have not arrived: ``extra``) and their prefix
        caches; it changes nothing but its own round-robin position.

- ``round_robin``: in turn;
- ``least_loaded``: fewest requests running + waiting, then the lowest index;
- ``prefix_affinity``: among the workers whose load stays under the bound
  ``ceil(affinity_load_ratio * (total load + 1) / replicas)`` (consistent hashing with
  bounded loads: the least loaded worker is always under it), the one with the longest
  cached prefix of the request, then the least loaded;
- ``kv_aware``: the lowest ``uncached prompt tokens + kv_aware_queue_weight * queued
  prefill tokens``, then the least loaded.
"""

from __future__ import annotations

from collections.abc import Sequence

from inference_lab.core.engine.request import Request
from inference_lab.core.engine.scheduler import Scheduler

__all__ = ["Router"]


class Router:
    """The deployment's routing policy over its workers (Rules 1 and 2)."""

    __slots__ = ("policy", "load_ratio", "queue_weight", "rr")

    def __init__(self, policy: str, load_ratio: float, queue_weight: float) -> None:
        self.policy = policy
        self.load_ratio = load_ratio
        self.queue_weight = queue_weight
        #: the round robin's next position
        self.rr = 0

    def choose(
        self, workers: Sequence[Scheduler], r: Request, extra: Sequence[int] | None = None
    ) -> Scheduler:
        """The worker ``r`` goes to; ``extra[i]`` requests already routed to worker ``i``
        and not yet arrived add to its load."""
        if len(workers) == 1:
            return workers[0]
        policy = self.policy

        def load(w: Scheduler) -> int:
            return w.load() if extra is None else w.load() + extra[w.index]

        if policy == "least_loaded":
            return min(workers, key=lambda w: (load(w), w.index))
        if policy == "prefix_affinity":
            loads = [load(w) for w in workers]
            bound = -(-self.load_ratio * (sum(loads) + 1) // len(workers))
            return min(
                (w for w, load in zip(workers, loads, strict=True) if load < bound),
                key=lambda w: (-w.kv.hit_tokens(r), loads[w.index], w.index),
            )
        if policy == "kv_aware":
            weight = self.queue_weight
            return min(
                workers,
                key=lambda w: (
                    r.prompt_tokens - w.kv.hit_tokens(r) + weight * w.queued_prefill(),
                    load(w),
                    w.index,
                ),
            )
        w = workers[self.rr % len(workers)]
        self.rr += 1
        return w
