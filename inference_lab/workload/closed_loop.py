"""Closed loops: N users, each sending its next request the moment its previous one
ends.

Rule 1: the users' start jitter is drawn once, first; then the lengths, chunk by chunk
        (:mod:`inference_lab.workload.arrivals`, Rule 2).
"""

from __future__ import annotations

import math

import numpy as np

from inference_lab.core.config import Workload
from inference_lab.errors import ConfigError
from inference_lab.workload.arrivals import Arrival, ArrivalGenerator, Lengths, check_bounded

__all__ = ["ClosedLoopGenerator"]


class ClosedLoopGenerator(ArrivalGenerator):
    """N users; each sends its next request the moment its previous one ends.

    First arrivals are U(0, closed_loop_jitter_secs) (all at 0 without jitter). A user stops
    once `num_requests` requests have been issued in all, or when its previous request ends at
    or after `duration_secs`.
    """

    closed_loop = True
    reactive = True

    def __init__(self, workload: Workload, rng: np.random.Generator) -> None:
        check_bounded(workload)
        users = workload.num_concurrent_users
        if users is None or users < 1:
            raise ConfigError("workload: closed_loop needs num_concurrent_users >= 1")
        self._workload = workload
        self._rng = rng
        self.total = workload.num_requests
        self._users = users
        self._issued = 0
        self._limit = workload.num_requests if workload.num_requests is not None else math.inf
        self._duration = workload.duration_secs if workload.duration_secs is not None else math.inf
        jitter = workload.closed_loop_jitter_secs
        self._starts: list[float] = (
            rng.uniform(0.0, jitter, users).tolist() if jitter > 0 else [0.0] * users
        )
        self._lengths = Lengths(workload, rng)

    def _issue(self, user: int, time: float) -> Arrival | None:
        if self._issued >= self._limit or time >= self._duration:
            return None
        self._issued += 1
        prompt, output = self._lengths.next()
        return Arrival(time, prompt, output, user)

    def initial(self) -> list[Arrival]:
        out = []
        for user, start in enumerate(self._starts):
            arrival = self._issue(user, start)
            if arrival is not None:
                out.append(arrival)
        return out

    def on_complete(self, user: int, time: float) -> Arrival | None:
        return self._issue(user, time)
