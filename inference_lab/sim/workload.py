"""Arrival generation for the offline simulator: a pure function of a `Workload` and a seed.

Rule 1: one `numpy.random.Generator` per workload, seeded with `Workload.seed` (or the
        caller's override). Nothing else is random, so the same seed gives the same requests.
Rule 2: samples are drawn in fixed-size chunks, in a fixed order (open loop: gaps, prompt
        lengths, output lengths; closed loop: the users' start jitter once, then lengths), so
        the first k requests do not depend on `num_requests` or `duration_secs`.
Rule 3: no clock and no engine: times are simulated seconds. A closed loop learns about
        completions from its caller (`on_complete`) and answers with that user's next request.
Rule 4: the first open-loop arrival is at t = 0 and arrival k is at the sum of the first k
        gaps (uniform: exactly k / rate). Generation stops at `num_requests` or before the
        first arrival at or after `duration_secs`, whichever comes first.

Lengths are sampled by the workload's distributions (`sample(rng, size)`: int64, floored,
>= 1); `output_len` is the number of tokens the request really produces (the engine's
`target`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import attrs
import numpy as np
import numpy.typing as npt

from inference_lab.core.config import Workload
from inference_lab.errors import ConfigError

__all__ = [
    "CHUNK",
    "Arrival",
    "ArrivalGenerator",
    "ClosedLoopGenerator",
    "OpenLoopGenerator",
    "make_generator",
    "make_rng",
]

#: Samples are drawn this many at a time (Rule 2). Changing it changes every workload's
#: requests, so it is a constant, not an option.
CHUNK = 1024

_BURST_PROBABILITY = 0.2
_BURST_SHORT_GAP = (0.001, 0.010)  # seconds: a request inside a burst
_BURST_LONG_GAP = (0.5, 2.0)  # seconds: the pause between bursts


@attrs.frozen
class Arrival:
    """One request to submit: when, how long its prompt is, how many tokens it produces."""

    time: float
    prompt_tokens: int
    output_len: int
    user: int = -1  # closed loop: the user that sends it; -1 for open-loop patterns


def make_rng(workload: Workload, seed: int | None = None) -> np.random.Generator:
    """The workload's one generator (Rule 1): `seed` when given (`--seed`), else
    `workload.seed`. Called by `make_generator` here and by serve for response lengths."""
    return np.random.default_rng(workload.seed if seed is None else seed)


class _Lengths:
    """An endless stream of (prompt_tokens, output_len) pairs drawn CHUNK at a time."""

    def __init__(self, workload: Workload, rng: np.random.Generator) -> None:
        self._workload = workload
        self._rng = rng
        self._iter = self._pairs()

    def _pairs(self) -> Iterator[tuple[int, int]]:
        while True:
            prompts, outputs = self.draw()
            yield from zip(prompts.tolist(), outputs.tolist(), strict=True)

    def draw(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """One chunk of prompt lengths then one chunk of output lengths (both >= 1)."""
        prompts = np.maximum(self._workload.input_len_dist.sample(self._rng, CHUNK), 1)
        outputs = np.maximum(self._workload.output_len_dist.sample(self._rng, CHUNK), 1)
        return prompts.astype(np.int64), outputs.astype(np.int64)

    def next(self) -> tuple[int, int]:
        return next(self._iter)


def _check_bounded(workload: Workload) -> None:
    if workload.num_requests is None and workload.duration_secs is None:
        raise ConfigError("workload: needs num_requests or duration_secs (else it never ends)")


class ArrivalGenerator:
    """The sim loop's view of a workload (made by `make_generator`, driven by
    `sim.run_simulation`).

    The caller submits everything `initial()` returns, then calls `on_complete(user, t)` for
    each finished (or refused) request; a closed loop answers with that user's next request.
    """

    closed_loop: bool = False

    def initial(self) -> list[Arrival]:
        """The arrivals known before the first step, in arrival order: every one of an open
        loop, each user's first of a closed loop."""
        raise NotImplementedError

    def on_complete(self, user: int, time: float) -> Arrival | None:
        """The next request of `user`, whose previous request ended at `time`, or None."""
        return None


class OpenLoopGenerator(ArrivalGenerator):
    """poisson / uniform / burst / batched: every arrival is known up front."""

    def __init__(self, workload: Workload, rng: np.random.Generator) -> None:
        _check_bounded(workload)
        pattern = workload.arrival_pattern
        if pattern not in ("poisson", "uniform", "burst", "batched"):
            raise ConfigError(f"workload: arrival_pattern {pattern!r} is not an open-loop pattern")
        if pattern in ("poisson", "uniform") and not workload.arrival_rate > 0:
            raise ConfigError(f"workload: arrival_rate must be > 0, got {workload.arrival_rate}")
        self._workload = workload
        self._rng = rng

    def _gaps(self, n: int) -> npt.NDArray[np.float64]:
        rng = self._rng
        pattern = self._workload.arrival_pattern
        rate = self._workload.arrival_rate
        if pattern == "poisson":
            return rng.exponential(1.0 / rate, n)
        if pattern == "burst":
            in_burst = rng.random(n) < _BURST_PROBABILITY
            short = rng.uniform(*_BURST_SHORT_GAP, n)
            long = rng.uniform(*_BURST_LONG_GAP, n)
            return np.where(in_burst, short, long)
        # uniform and batched need no randomness (uniform times are computed exactly below)
        return np.zeros(n)

    def _arrays(
        self,
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """All arrivals as (times, prompt_tokens, output_lens), in arrival order."""
        wl = self._workload
        limit = wl.num_requests if wl.num_requests is not None else math.inf
        duration = wl.duration_secs if wl.duration_secs is not None else math.inf
        lengths = _Lengths(wl, self._rng)
        times: list[npt.NDArray[np.float64]] = []
        prompts: list[npt.NDArray[np.int64]] = []
        outputs: list[npt.NDArray[np.int64]] = []
        produced = 0
        next_t = 0.0
        while produced < limit:
            gaps = self._gaps(CHUNK)
            chunk_prompts, chunk_outputs = lengths.draw()
            if wl.arrival_pattern == "uniform":
                t = np.arange(produced, produced + CHUNK, dtype=np.float64) / wl.arrival_rate
            else:
                t = next_t + np.concatenate(([0.0], np.cumsum(gaps[:-1])))
                next_t = float(t[-1] + gaps[-1])
            keep = CHUNK if limit - produced >= CHUNK else int(limit - produced)
            past = np.flatnonzero(t[:keep] >= duration)
            if past.size:
                keep = int(past[0])
            times.append(t[:keep])
            prompts.append(chunk_prompts[:keep])
            outputs.append(chunk_outputs[:keep])
            produced += keep
            if keep < CHUNK:
                break
        return (
            np.concatenate(times) if times else np.zeros(0),
            np.concatenate(prompts) if prompts else np.zeros(0, np.int64),
            np.concatenate(outputs) if outputs else np.zeros(0, np.int64),
        )

    def initial(self) -> list[Arrival]:
        times, prompts, outputs = self._arrays()
        return [
            Arrival(t, p, o)
            for t, p, o in zip(times.tolist(), prompts.tolist(), outputs.tolist(), strict=True)
        ]


class ClosedLoopGenerator(ArrivalGenerator):
    """N users; each sends its next request the moment its previous one ends.

    First arrivals are U(0, closed_loop_jitter_secs) (all at 0 without jitter). A user stops
    once `num_requests` requests have been issued in all, or when its previous request ends at
    or after `duration_secs`.
    """

    closed_loop = True

    def __init__(self, workload: Workload, rng: np.random.Generator) -> None:
        _check_bounded(workload)
        users = workload.num_concurrent_users
        if users is None or users < 1:
            raise ConfigError("workload: closed_loop needs num_concurrent_users >= 1")
        self._workload = workload
        self._rng = rng
        self._users = users
        self._issued = 0
        self._limit = workload.num_requests if workload.num_requests is not None else math.inf
        self._duration = workload.duration_secs if workload.duration_secs is not None else math.inf
        jitter = workload.closed_loop_jitter_secs
        self._starts: list[float] = (
            rng.uniform(0.0, jitter, users).tolist() if jitter > 0 else [0.0] * users
        )
        self._lengths = _Lengths(workload, rng)

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


def make_generator(workload: Workload, seed: int | None = None) -> ArrivalGenerator:
    """The generator for `workload`'s arrival pattern, seeded per `make_rng`.

    Raises ConfigError for a workload that is unbounded or lacks what its pattern needs.
    """
    rng = make_rng(workload, seed)
    if workload.arrival_pattern == "closed_loop":
        return ClosedLoopGenerator(workload, rng)
    return OpenLoopGenerator(workload, rng)
