"""The sampled time series of a simulation, for ``sim --timeseries`` and ``sim --report``.

Rule 1: a series is sampled at a fixed interval of simulated time: one point per interval
        whatever the number of steps or requests in it, so its memory grows with the
        simulated time over the interval, never with steps or requests.
Rule 2: the recorder does constant work per engine event (counter additions; a finished
        request's TTFT and TPOT join its interval's lists) and one ``engine.statistics()``
        per interval it closes. An interval is closed before the first event at or after
        its end is stepped, so its end-of-interval figures are the engine's state then.
Rule 3: a point's counts (arrivals, refusals, completions, preemptions, tokens, steps)
        are of its interval; running, waiting, KV usage and each replica's figures are the
        engine's at the interval's end; TTFT / TPOT percentiles are over the requests that
        finished in the interval (None when none did); the prefix-cache hit rate is over
        the tokens looked up at the admissions in it.
Rule 4: pure: no clock, no I/O; the simulation loop hands it the events and the engine.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from typing import IO, Any, Protocol

import attrs
import numpy as np

from inference_lab.core.engine import EngineStatistics, StepEvents
from inference_lab.sim.observers import RunObserver

__all__ = ["DEFAULT_INTERVAL", "Series", "SeriesPoint", "SeriesRecorder"]

#: Simulated seconds per point unless ``--series-interval`` says otherwise.
DEFAULT_INTERVAL = 0.5


class _Engine(Protocol):
    def statistics(self) -> EngineStatistics: ...


@attrs.frozen(kw_only=True)
class ReplicaPoint:
    """One replica at the end of an interval (hits and queries: in the interval)."""

    running: int
    waiting: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int


@attrs.frozen(kw_only=True)
class SeriesPoint:
    """One interval of simulated time (Rule 3). Latencies in ms."""

    t_start: float
    t_end: float
    arrivals: int
    refused: int
    finished: int
    preemptions: int
    output_tokens: int
    computed_tokens: int
    steps: int
    running: int
    waiting: int
    kv_usage: float
    kv_usage_mean: float | None
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    prefix_queries: int
    prefix_hits: int
    replicas: tuple[ReplicaPoint, ...]

    @property
    def output_tokens_per_s(self) -> float:
        span = self.t_end - self.t_start
        return self.output_tokens / span if span > 0 else 0.0

    @property
    def computed_tokens_per_s(self) -> float:
        span = self.t_end - self.t_start
        return self.computed_tokens / span if span > 0 else 0.0

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else None


#: The CSV's columns (then, with several replicas, ``r<i>_<field>`` per replica).
COLUMNS = (
    "t_start_s",
    "t_end_s",
    "arrivals",
    "refused",
    "finished",
    "preemptions",
    "output_tokens",
    "output_tokens_per_s",
    "computed_tokens_per_s",
    "steps",
    "running",
    "waiting",
    "kv_usage",
    "kv_usage_mean",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "prefix_hit_rate",
)
REPLICA_COLUMNS = ("running", "waiting", "kv_usage", "prefix_hit_rate")


@attrs.frozen(kw_only=True)
class Series:
    """A run's sampled series: the interval and one point per interval, in time order."""

    interval: float
    replicas: int
    points: tuple[SeriesPoint, ...]

    def columns(self) -> dict[str, list[Any]]:
        """Column name -> one value per point (the CSV's columns; None for no value)."""
        out: dict[str, list[Any]] = {name: [] for name in self.column_names()}
        for p in self.points:
            row = self._row(p)
            for name in out:
                out[name].append(row[name])
        return out

    def column_names(self) -> list[str]:
        names = list(COLUMNS)
        if self.replicas > 1:
            for i in range(self.replicas):
                names += [f"r{i}_{field}" for field in REPLICA_COLUMNS]
        return names

    def _row(self, p: SeriesPoint) -> dict[str, Any]:
        row: dict[str, Any] = {
            "t_start_s": p.t_start,
            "t_end_s": p.t_end,
            "arrivals": p.arrivals,
            "refused": p.refused,
            "finished": p.finished,
            "preemptions": p.preemptions,
            "output_tokens": p.output_tokens,
            "output_tokens_per_s": p.output_tokens_per_s,
            "computed_tokens_per_s": p.computed_tokens_per_s,
            "steps": p.steps,
            "running": p.running,
            "waiting": p.waiting,
            "kv_usage": p.kv_usage,
            "kv_usage_mean": p.kv_usage_mean,
            "ttft_p50_ms": p.ttft_p50_ms,
            "ttft_p90_ms": p.ttft_p90_ms,
            "ttft_p99_ms": p.ttft_p99_ms,
            "tpot_p50_ms": p.tpot_p50_ms,
            "tpot_p99_ms": p.tpot_p99_ms,
            "prefix_hit_rate": p.prefix_hit_rate,
        }
        if self.replicas > 1:
            for i, r in enumerate(p.replicas):
                row[f"r{i}_running"] = r.running
                row[f"r{i}_waiting"] = r.waiting
                row[f"r{i}_kv_usage"] = r.kv_usage
                row[f"r{i}_prefix_hit_rate"] = (
                    r.prefix_hits / r.prefix_queries if r.prefix_queries else None
                )
        return row

    def write_csv(self, out: IO[str]) -> int:
        """One row per point (an empty cell for no value); returns the row count."""
        writer = csv.DictWriter(out, fieldnames=self.column_names())
        writer.writeheader()
        for p in self.points:
            writer.writerow({k: ("" if v is None else v) for k, v in self._row(p).items()})
        return len(self.points)


def _percentiles(values: Sequence[float], qs: tuple[int, ...]) -> list[float | None]:
    if not values:
        return [None] * len(qs)
    out = np.percentile(np.asarray(values, dtype=np.float64) * 1e3, qs)
    return [float(v) for v in out]


class SeriesRecorder(RunObserver):
    """Builds a :class:`Series` while the simulation runs (module rules). An observer of
    the loop (:mod:`inference_lab.sim.observers`): before it steps an event at or after
    :attr:`end` (its :attr:`due`) it closes the intervals up to it (:meth:`close_until`),
    it sees each step's events (:meth:`observe`), the ``max_waiting`` bound tells it of
    each refusal (:meth:`refused`), and :meth:`finish` is called once at the end."""

    takes_runs = False  # (an interval must close before the first event past its end)

    def __init__(self, interval: float, engine: _Engine) -> None:
        if not interval > 0:
            raise ValueError(f"the series interval must be > 0, got {interval}")
        self.interval = interval
        self._engine = engine
        stats = engine.statistics()
        self._replicas = len(stats.workers)
        self._points: list[SeriesPoint] = []
        self._index = 0  # of the open interval
        self.end = self.due = interval  # where the open interval ends
        self._queries = [w.prefix_cache_queries for w in stats.workers]
        self._hits = [w.prefix_cache_hits for w in stats.workers]
        self._reset()

    def _reset(self) -> None:
        self._arrivals = 0
        self._refused = 0
        self._finished = 0
        self._preemptions = 0
        self._tokens = 0
        self._computed = 0
        self._steps = 0
        self._kv_sum = 0.0
        self._ttft: list[float] = []
        self._tpot: list[float] = []

    def observe(self, ev: StepEvents) -> None:
        """Count one step's events into the open interval (constant work but for the
        finished requests' latencies)."""
        self._arrivals += len(ev.arrived)
        # a request emits at most one token per sequence per step: one entry each; a
        # request of n > 1 sequences adds its other n - 1 sequences' tokens at its finish
        self._tokens += len(ev.tokens)
        info = ev.step
        if info is not None:
            self._steps += 1
            self._computed += info.num_tokens
            self._kv_sum += info.kv_usage
            self._preemptions += info.preempted
        for f in ev.finished:
            self._finished += 1
            self._ttft.append(f.first_token_time - f.arrival_time)
            if f.output_tokens > 1:
                self._tpot.append((f.finish_time - f.first_token_time) / (f.output_tokens - 1))
            if f.n > 1:
                self._tokens += (f.n - 1) * f.output_tokens

    on_step = observe

    def before_step(self, time: float) -> None:
        self.close_until(time, self._engine)

    def refused(self) -> None:
        """One arrival of the open interval was refused by ``max_waiting``."""
        self._refused += 1

    def close_until(self, time: float, engine: _Engine) -> float:
        """Close every interval that ends at or before ``time`` (the next event's time),
        with the engine's state now as their end state; returns the new :attr:`end`."""
        stats = engine.statistics()
        while self.end <= time:
            self._close(self.end, stats)
        return self.end

    def finish(self, time: float, engine: _Engine) -> Series:
        """Close the intervals up to ``time`` (the run's end) and the last, partial one."""
        self.close_until(time, engine)
        if time > self.end - self.interval or self._steps or self._finished:
            self._close(max(time, self.end - self.interval), engine.statistics())
        return Series(interval=self.interval, replicas=self._replicas, points=tuple(self._points))

    def _close(self, end: float, stats: EngineStatistics) -> None:
        start = self._index * self.interval
        replicas = []
        total_q = total_h = 0
        for i, w in enumerate(stats.workers):
            q = w.prefix_cache_queries - self._queries[i]
            h = w.prefix_cache_hits - self._hits[i]
            self._queries[i], self._hits[i] = w.prefix_cache_queries, w.prefix_cache_hits
            total_q += q
            total_h += h
            replicas.append(
                ReplicaPoint(
                    running=w.running,
                    waiting=w.waiting,
                    kv_usage=w.kv_used_blocks / w.kv_total_blocks if w.kv_total_blocks else 0.0,
                    prefix_queries=q,
                    prefix_hits=h,
                )
            )
        ttft = _percentiles(self._ttft, (50, 90, 99))
        tpot = _percentiles(self._tpot, (50, 99))
        self._points.append(
            SeriesPoint(
                t_start=start,
                t_end=end,
                arrivals=self._arrivals,
                refused=self._refused,
                finished=self._finished,
                preemptions=self._preemptions,
                output_tokens=self._tokens,
                computed_tokens=self._computed,
                steps=self._steps,
                running=stats.running,
                waiting=stats.waiting,
                kv_usage=stats.kv_usage,
                kv_usage_mean=self._kv_sum / self._steps if self._steps else None,
                ttft_p50_ms=ttft[0],
                ttft_p90_ms=ttft[1],
                ttft_p99_ms=ttft[2],
                tpot_p50_ms=tpot[0],
                tpot_p99_ms=tpot[1],
                prefix_queries=total_q,
                prefix_hits=total_h,
                replicas=tuple(replicas),
            )
        )
        self._index += 1
        self.end = self.due = (self._index + 1) * self.interval
        self._reset()
