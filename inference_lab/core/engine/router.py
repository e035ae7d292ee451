"""Which replica an arrival goes to: the deployment's ``router``.

Rule 1: a deployment of one worker never asks the router (its answer is that worker).
Rule 2: the router reads the workers' load (requests running + waiting, plus the requests
        the serving layer routed there that have not arrived: ``extra``) and their prefix
        caches; it changes nothing but its own count of the arrivals it placed (``rr``).
Rule 3: ``round_robin``, ``random`` and ``session_affinity`` read no worker: their answer
        is a pure function of the arrival's index ``k`` (the arrivals placed before it),
        its session and ``router_seed``, so a deployment's replicas under them can be
        simulated apart (``sim --ray``). Their draws are SplitMix64's (:func:`draw`), not
        Python's ``hash()``, whose salt changes from process to process.

- ``round_robin``: in turn (arrival ``k`` to worker ``k mod W``);
- ``random``: arrival ``k`` to worker ``draw(router_seed, k) mod W``;
- ``session_affinity``: every turn of session ``s`` to worker ``draw(router_seed, s) mod W``;
  a request without a session as ``random`` places it;
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

__all__ = ["Router", "draw"]

_MASK = (1 << 64) - 1
#: SplitMix64's increment (2**64 / the golden ratio, odd)
_GOLDEN = 0x9E3779B97F4A7C15


def draw(seed: int, key: int) -> int:
    """The ``key``-th output (from 0) of a SplitMix64 generator seeded with ``seed``: a
    64-bit integer, a pure function of the two (Rule 3). Vigna's reference: seed 1234567
    gives 6457827717110365317, 3203168211198807973, ... The sharded simulation computes
    the same over arrays (``sim.shard``)."""
    z = (seed + (key + 1) * _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


class Router:
    """The deployment's routing policy over its workers (Rules 1 and 2)."""

    __slots__ = ("policy", "load_ratio", "queue_weight", "seed", "rr")

    def __init__(self, policy: str, load_ratio: float, queue_weight: float, seed: int = 0) -> None:
        self.policy = policy
        self.load_ratio = load_ratio
        self.queue_weight = queue_weight
        #: ``random``'s and ``session_affinity``'s seed (Rule 3)
        self.seed = seed
        #: the next arrival's index: round robin's position, random's key (Rule 3)
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
        k = self.rr
        self.rr = k + 1
        if policy == "round_robin":
            return workers[k % len(workers)]
        if policy == "session_affinity" and r.session is not None:
            return workers[draw(self.seed, r.session) % len(workers)]
        return workers[draw(self.seed, k) % len(workers)]  # random (Rule 3)
