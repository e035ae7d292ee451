"""Open loops: poisson, uniform, burst and batched arrivals, every one known up front.

Rule 1: the first arrival is at t = 0 and arrival k is at the sum of the first k gaps
        (uniform: exactly k / rate). Generation stops at ``num_requests`` or before the
        first arrival at or after ``duration_secs``, whichever comes first.
Rule 2: with a ``[rate_schedule]``, the gaps are drawn at rate 1 (uniform: the integers)
        and mapped through the schedule's cumulative rate
        (``traffic.schedules.arrival_times``).
Rule 3: each chunk draws its gaps, then its prompt lengths, then its output lengths
        (:mod:`inference_lab.workload.arrivals`, Rule 2).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from inference_lab.core.config import Workload
from inference_lab.errors import ConfigError
from inference_lab.traffic.schedules import arrival_times
from inference_lab.workload.arrivals import (
    CHUNK,
    Arrival,
    ArrivalArrays,
    ArrivalGenerator,
    Lengths,
    check_bounded,
)

__all__ = ["ChunkMark", "OpenLoopGenerator", "chunk_times"]

_BURST_PROBABILITY = 0.2
_BURST_SHORT_GAP = (0.001, 0.010)  # seconds: a request inside a burst
_BURST_LONG_GAP = (0.5, 2.0)  # seconds: the pause between bursts


def chunk_times(
    wl: Workload, gaps: npt.NDArray[np.float64], produced: int, next_t: float
) -> tuple[npt.NDArray[np.float64], float]:
    """The times of the open-loop chunk whose first arrival is number ``produced`` and
    whose unit-clock time is ``next_t`` (Rule 4), and the next chunk's ``next_t``."""
    schedule = wl.rate_schedule
    if wl.arrival_pattern == "uniform":
        unit = np.arange(produced, produced + CHUNK, dtype=np.float64)
        if schedule is None:
            return unit / wl.arrival_rate, next_t
        return arrival_times(schedule, unit), next_t
    t = next_t + np.concatenate(([0.0], np.cumsum(gaps[:-1])))
    next_t = float(t[-1] + gaps[-1])
    if schedule is not None:
        t = arrival_times(schedule, t)
    return t, next_t


@attrs.frozen
class ChunkMark:
    """Where an open loop's stream stands before a chunk (:meth:`OpenLoopGenerator.
    marked_chunks`): its generator's state, the arrivals drawn before, and the (unit
    clock) time of the chunk's first arrival."""

    state: Mapping[str, Any]
    produced: int
    next_t: float


class OpenLoopGenerator(ArrivalGenerator):
    """poisson / uniform / burst / batched: every arrival is known up front."""

    def __init__(self, workload: Workload, rng: np.random.Generator, check: bool = True) -> None:
        if check:
            check_bounded(workload)
        pattern = workload.arrival_pattern
        if pattern not in ("poisson", "uniform", "burst", "batched"):
            raise ConfigError(f"workload: arrival_pattern {pattern!r} is not an open-loop pattern")
        if pattern in ("poisson", "uniform") and not workload.arrival_rate > 0:
            raise ConfigError(f"workload: arrival_rate must be > 0, got {workload.arrival_rate}")
        self._workload = workload
        self._rng = rng
        self.total = workload.num_requests

    def gaps(self, n: int) -> npt.NDArray[np.float64]:
        """The next ``n`` gaps between arrivals (on the unit clock with a rate schedule,
        Rule 2; zeros for uniform and batched arrivals, whose times need none)."""
        rng = self._rng
        pattern = self._workload.arrival_pattern
        rate = self._workload.arrival_rate
        if self._workload.rate_schedule is not None:
            rate = 1.0  # drawn on the unit clock, then mapped (Rule 4)
        if pattern == "poisson":
            return rng.exponential(1.0 / rate, n)
        if pattern == "burst":
            in_burst = rng.random(n) < _BURST_PROBABILITY
            short = rng.uniform(*_BURST_SHORT_GAP, n)
            long = rng.uniform(*_BURST_LONG_GAP, n)
            return np.where(in_burst, short, long)
        # uniform and batched need no randomness (uniform times are computed exactly below)
        return np.zeros(n)

    def arrays(self) -> ArrivalArrays:
        """All arrivals as arrays, in arrival order (the interface's lazy feed)."""
        return self._draw()

    def chunks(self) -> Iterator[ArrivalArrays]:
        """Every arrival, in arrival order, one chunk of at most CHUNK at a time (Rules
        1-3): the arrays :meth:`arrays` returns, cut where they were drawn. A sharded
        simulation reads a long run's arrivals this way, without holding them all."""
        return (arrays for _, arrays in self.marked_chunks())

    def marked_chunks(
        self, every: int = 0, start: ChunkMark | None = None
    ) -> Iterator[tuple[ChunkMark | None, ArrivalArrays]]:
        """:meth:`chunks`, each with the :class:`ChunkMark` of the stream before it when
        it is the first after ``start`` (default: the stream's start) or a multiple of
        ``every`` chunks after it (None otherwise: a mark copies the generator's state).
        From ``start``, the stream goes on as it went on from that mark; the generator
        must hold the mark's state (:meth:`resume` makes one that does)."""
        wl = self._workload
        limit = wl.num_requests if wl.num_requests is not None else math.inf
        duration = wl.duration_secs if wl.duration_secs is not None else math.inf
        lengths = Lengths(wl, self._rng)
        produced, next_t = (0, 0.0) if start is None else (start.produced, start.next_t)
        index = 0
        while produced < limit:
            mark = None
            if index == 0 or (every and index % every == 0):
                mark = ChunkMark(self._rng.bit_generator.state, produced, next_t)
            index += 1
            gaps = self.gaps(CHUNK)
            chunk_prompts, chunk_outputs = lengths.draw()
            t, next_t = chunk_times(wl, gaps, produced, next_t)
            keep = CHUNK if limit - produced >= CHUNK else int(limit - produced)
            past = np.flatnonzero(t[:keep] >= duration)
            if wl.rate_schedule is not None:  # a schedule whose rate ends: no time at all
                past = np.flatnonzero((t[:keep] >= duration) | np.isinf(t[:keep]))
            if past.size:
                keep = int(past[0])
            if keep:
                yield mark, ArrivalArrays(t[:keep], chunk_prompts[:keep], chunk_outputs[:keep])
            produced += keep
            if keep < CHUNK:
                break

    @classmethod
    def resume(cls, workload: Workload, mark: ChunkMark) -> OpenLoopGenerator:
        """A generator of ``workload`` whose :meth:`marked_chunks` from ``mark`` draw what
        followed the mark."""
        rng = np.random.default_rng()
        rng.bit_generator.state = mark.state
        return cls(workload, rng)

    def _draw(self) -> ArrivalArrays:
        """Every arrival, drawn chunk by chunk (Rules 1-3)."""
        parts = list(self.chunks())
        return ArrivalArrays(
            np.concatenate([c.times for c in parts]) if parts else np.zeros(0),
            np.concatenate([c.prompt_tokens for c in parts]) if parts else np.zeros(0, np.int64),
            np.concatenate([c.output_lens for c in parts]) if parts else np.zeros(0, np.int64),
        )

    def initial(self) -> list[Arrival]:
        times, prompts, outputs = self._draw()
        return [
            Arrival(t, p, o)
            for t, p, o in zip(times.tolist(), prompts.tolist(), outputs.tolist(), strict=True)
        ]
