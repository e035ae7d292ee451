"""One shard of a sharded simulation: some of a deployment's replicas, run on exactly the
arrivals the deployment's round robin gives them, reported as figures that merge.

Rule 1: a :class:`ShardJob` holds everything its run reads -- the whole deployment (all
        its replicas), the open-loop workload, the seed, the replicas the shard owns --
        and never a path: :func:`run_shard` is a pure function of it and of the code, so
        a job gives the same :class:`ShardResult` on any worker, however often it is run
        or retried (``ShardResult.timing`` says how and where it ran; nothing else
        depends on that).
Rule 2: the shard draws the workload's whole arrival stream, chunk by chunk, exactly as
        an unsharded run draws it (a trace: reads it whole), and keeps the arrivals
        routed to its replicas: the ``k``-th arrival the deployment can run (in the
        order the engine handles arrivals; a request that can never run is refused at
        submission and takes no turn) goes where the router sends it
        (:func:`~inference_lab.sim.sharding.route`: ``k mod W``, or a SplitMix64 draw of
        ``k``). It runs them on a deployment of its own replicas only (its workers are
        the owned ones, in index order), handing each its worker (``RequestSpec.worker``)
        in the unsharded run's submission order, so each request's times and each step's
        figures are the unsharded run's, bit for bit.
Rule 3: its loop is the simulator's (``sim.run``: the arrivals fed lazily, the events
        before the next feed handled as one ``Engine.run_until``), with records that are
        folded every :data:`FOLD_REQUESTS` completions and :data:`FOLD_STEPS` steps into
        counts, sums, maxima and the quantile sketches of TTFT, TPOT, E2E and queue time
        (:mod:`inference_lab.sim.sketch`), then emptied. What a shard holds is its own
        arrivals (three arrays, their workers and the feed's index: 36 bytes a request),
        the engine's
        requests in flight, at most a fold's worth of records, one number per chunk of
        the stream and a mark of the stream (the generator's state) every
        :data:`MARK_EVERY` chunks.
Rule 4: the figures that need the whole stream (the first arrival, the capacity
        window, the requests that can never run) are computed by every shard from the
        stream it draws; the refusals are counted by the job with ``counts_refusals``
        only, so merged they count once.
Rule 5: the capacity verdict's two queue readings are taken where the unsharded run
        takes them: right after the last arrival (of the whole stream) at or before the
        middle of the arrival window, and right after the last arrival -- after every
        event before that arrival's time and every arrival at it. The shard finds those
        times in its first pass (the middle's from the chunk it falls in, drawn again
        from the mark before it), stops its run there and counts its replicas' waiting
        requests; the shards' counts add up to the unsharded run's. Its peak waiting
        queue is its own replicas' (merged, an upper bound of the run's).

Who calls this: :mod:`inference_lab.sim.fleet` builds the jobs and merges the results;
an executor (:mod:`inference_lab.executors`) runs :func:`run_shard` in this process, a
process pool or a Ray task.
"""

from __future__ import annotations

import math
import os
import socket
import time
from array import array
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from inference_lab.core.config import Workload
from inference_lab.core.engine import Engine, Finished, RequestSpec
from inference_lab.core.engine.limits import fits_total
from inference_lab.errors import ConfigError
from inference_lab.sim.intake import Intake, OpenLoopFeed
from inference_lab.sim.shard_figures import (
    FOLD_REQUESTS,
    FOLD_STEPS,
    LATENCIES,
    Folder,
    Queue,
    ShardJob,
    ShardResult,
    Stream,
    WorkerFigures,
    first_worker,
    owned_workers,
    shard_deployment,
    shard_result,
)
from inference_lab.sim.shard_sessions import run_session_shard
from inference_lab.sim.sharding import ShardTiming, route
from inference_lab.traffic.traces import Trace
from inference_lab.workload import TraceGenerator, make_generator
from inference_lab.workload.arrivals import Arrival, ArrivalArrays, ArrivalGenerator
from inference_lab.workload.open_loop import OpenLoopGenerator

__all__ = [
    "FOLD_REQUESTS",
    "FOLD_STEPS",
    "LATENCIES",
    "ShardJob",
    "ShardResult",
    "WorkerFigures",
    "run_shard",
    "shard_deployment",
]

#: Every this many chunks of the stream, a shard keeps a mark to draw it again from
#: (Rule 5).
MARK_EVERY = 16


def _fits(
    engine: Engine, stream: Stream, chunk: ArrivalArrays, count: bool
) -> npt.NDArray[np.bool_]:
    """Which of ``chunk``'s arrivals the deployment can run (the engine's own check,
    asked only past the total every check passes); with ``count``, the others are
    counted as refusals."""
    _, prompts, outputs = chunk
    fit = (prompts + outputs) <= fits_total(engine.deployment, engine.roofline)
    for i in np.flatnonzero(~fit).tolist():
        refused = engine.check_fits(int(prompts[i]), int(outputs[i]))
        if refused is None:
            fit[i] = True
        elif count:
            stream.refusals[refused.limit] = stream.refusals.get(refused.limit, 0) + 1
            stream.first_refusal = stream.first_refusal or refused.reason
    return fit


def _stamps(engine: Engine, times: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """The engine times of arrivals at ``times`` (engine Rule 7: plus the frontend
    latency, as ``Engine.submit`` adds it)."""
    frontend = engine.deployment.scheduler.frontend_latency
    return times + frontend if frontend else times


def _select(job: ShardJob, engine: Engine) -> Stream:
    """The first pass (Rules 2 and 4): the whole stream drawn chunk by chunk, the arrivals
    routed to this shard's workers kept."""
    generator = make_generator(job.workload, job.seed)
    if not isinstance(generator, OpenLoopGenerator):  # (the fleet checked it)
        raise ConfigError("workload: a shard runs an open-loop workload or a trace")
    owned = owned_workers(job)
    first = first_worker(job)
    stream = Stream(ArrivalArrays(np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64)))
    parts: list[ArrivalArrays] = []
    hints: list[npt.NDArray[np.int32]] = []
    routed = 0  # arrivals the deployment can run, so far: round robin's position
    last_stamp = -math.inf
    for mark, chunk in generator.marked_chunks(MARK_EVERY):
        if mark is not None:
            stream.marks.append(mark)
        times = chunk.times
        stream.count += len(times)
        stream.first = min(stream.first, float(times.min()))
        stream.last = max(stream.last, float(times.max()))
        fit = _fits(engine, stream, chunk, job.counts_refusals)
        position = routed + np.cumsum(fit) - 1
        routed += int(np.count_nonzero(fit))
        if fit.any():
            stream.first_offered = min(stream.first_offered, float(times[fit].min()))
            stream.last_offered = max(stream.last_offered, float(times[fit].max()))
            last_stamp = float(_stamps(engine, times[fit]).max())
        stream.chunk_last_stamp.append(last_stamp)
        workers = route(job.deployment, position)
        mine: npt.NDArray[np.bool_] = fit & owned[workers]
        if mine.any():
            parts.append(
                ArrivalArrays(chunk.times[mine], chunk.prompt_tokens[mine], chunk.output_lens[mine])
            )
            hints.append((workers[mine] - first).astype(np.int32))
    if parts:
        stream.own = ArrivalArrays(*(np.concatenate(c) for c in zip(*parts, strict=True)))
        stream.hints = np.concatenate(hints)
    return stream


def _select_trace(job: ShardJob, engine: Engine, trace: Trace) -> Stream:
    """A trace's first pass (Rules 2 and 4): every request checked as the engine checks
    it, those the deployment can run placed in the order the engine handles their
    arrivals (by engine time, then the trace's order: all are submitted before the first
    step), the ones routed to this shard's workers kept in the trace's order."""
    sched = job.deployment.scheduler
    block_size = sched.block_size if sched.enable_prefix_caching else None
    arrivals = TraceGenerator(trace, block_size).initial()
    stream = Stream(ArrivalArrays(np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64)))
    if not arrivals:
        return stream
    times = np.array([a.time for a in arrivals], np.float64)
    fit = np.ones(len(arrivals), np.bool_)
    total = fits_total(engine.deployment, engine.roofline)
    for i, a in enumerate(arrivals):
        if a.n != 1 or a.prompt_tokens + a.output_len > total:
            refused = engine.check_fits(a.prompt_tokens, a.output_len, a.n)
            if refused is not None:
                fit[i] = False
                if job.counts_refusals:
                    stream.refusals[refused.limit] = stream.refusals.get(refused.limit, 0) + 1
                    stream.first_refusal = stream.first_refusal or refused.reason
    stream.count = len(arrivals)
    stream.first, stream.last = float(times.min()), float(times.max())
    fits = np.flatnonzero(fit)
    stamps = np.maximum(_stamps(engine, times[fits]), 0.0)  # (submitted at time 0)
    position = np.empty(len(fits), np.int64)
    position[np.argsort(stamps, kind="stable")] = np.arange(len(fits))
    workers = route(job.deployment, position)
    mine = owned_workers(job)[workers]
    own = fits[mine]
    stream.trace_own = [arrivals[i] for i in own.tolist()]
    stream.hints = (workers[mine] - first_worker(job)).astype(np.int32)
    stream.own = ArrivalArrays(
        times[own],
        np.array([a.prompt_tokens for a in stream.trace_own], np.int64),
        np.array([a.output_len for a in stream.trace_own], np.int64),
    )
    if len(fits):
        stream.first_offered = float(times[fits].min())
        stream.last_offered = float(times[fits].max())
        ordered = np.sort(stamps)
        stream.chunk_last_stamp = array("d", ordered.tolist())
    return stream


def _last_stamp_until(job: ShardJob, engine: Engine, stream: Stream, bound: float) -> float | None:
    """The engine time of the last arrival that can run at or before ``bound``, or None
    (Rule 5): read from the chunks' last times, or, when ``bound`` falls inside a chunk,
    from that chunk drawn again from the mark before it."""
    lasts = np.frombuffer(stream.chunk_last_stamp, dtype=np.float64)
    chunk = int(np.searchsorted(lasts, bound, side="right"))  # the first past ``bound``
    before = float(lasts[chunk - 1]) if chunk > 0 and lasts[chunk - 1] > -math.inf else None
    if chunk == len(lasts):
        return before
    mark = stream.marks[chunk // MARK_EVERY]
    assert isinstance(job.workload, Workload)  # (a trace's stamps are all at hand)
    drawn = OpenLoopGenerator.resume(job.workload, mark).marked_chunks(start=mark)
    for _ in range(chunk % MARK_EVERY):
        next(drawn)
    _, arrays = next(drawn)
    stamps = _stamps(engine, arrays.times)[_fits(engine, stream, arrays, False)]
    inside = stamps[stamps <= bound]
    return float(inside.max()) if inside.size else before


def _trace_stamp_until(stream: Stream, bound: float) -> float | None:
    """A trace's :func:`_last_stamp_until`: its stamps are all at hand, in order."""
    stamps = np.frombuffer(stream.chunk_last_stamp, dtype=np.float64)
    before = int(np.searchsorted(stamps, bound, side="right"))
    return float(stamps[before - 1]) if before else None


class _OwnArrivals(ArrivalGenerator):
    """A shard's arrivals as the loop takes an open loop's (arrays, fed lazily)."""

    def __init__(self, arrays: ArrivalArrays) -> None:
        self._arrays = arrays
        self.total = len(arrays.times)

    def arrays(self) -> ArrivalArrays:
        return self._arrays


def run_shard(job: ShardJob) -> ShardResult:
    """Run ``job``'s shard (module rules; a session workload's:
    :mod:`inference_lab.sim.shard_sessions`). Raises ConfigError for a workload the fleet
    refuses (:mod:`inference_lab.sim.fleet` checks that first)."""
    if isinstance(job.workload, Workload) and job.workload.sessions is not None:
        return run_session_shard(job)
    start, cpu = time.perf_counter(), time.process_time()
    engine = Engine(shard_deployment(job.deployment, len(job.replicas)))
    trace = job.workload if isinstance(job.workload, Trace) else None
    stream = _select(job, engine) if trace is None else _select_trace(job, engine, trace)
    select_cpu = time.process_time() - cpu
    # the queue readings' times (Rule 5): the unsharded run's watch reads the queue after
    # the last arrival at or before the middle of every arrival's time, and the last
    middle = (stream.first + stream.last) / 2
    if trace is None:
        readings = [
            _last_stamp_until(job, engine, stream, middle),
            _last_stamp_until(job, engine, stream, math.inf),
        ]
    else:
        readings = [_trace_stamp_until(stream, middle), _trace_stamp_until(stream, math.inf)]
    mid = (stream.first_offered + stream.last_offered) / 2
    folder = Folder(len(engine.workers), (mid, stream.last_offered))
    queue = _run(engine, stream, folder, readings)
    folder.fold()
    timing = ShardTiming(
        wall_s=time.perf_counter() - start,
        cpu_s=time.process_time() - cpu,
        select_cpu_s=select_cpu,
        host=f"{socket.gethostname()}:{os.getpid()}",
    )
    return shard_result(job, engine, stream, folder, queue, timing)


def _submit_trace(engine: Engine, arrivals: Sequence[Arrival], hints: Sequence[int]) -> None:
    """A trace's own arrivals, submitted up front in the trace's order as the unsharded
    run submits them (``Intake.submit``: each can run), each to its worker."""
    for a, worker in zip(arrivals, hints, strict=True):
        engine.submit(
            RequestSpec(
                prompt_tokens=a.prompt_tokens,
                max_tokens=a.output_len,
                arrival_time=a.time,
                n=a.n,
                block_hashes=a.block_hashes,
                worker=worker,
            )
        )


def _run(engine: Engine, stream: Stream, folder: Folder, readings: list[float | None]) -> Queue:
    """The simulator's loop (``sim.run.drive`` with no observer but the folds): the own
    arrivals fed lazily (a trace's submitted up front), each to its worker, the events
    before the next feed handled as runs, stopping at each reading's time to read the
    queue as the unsharded run's watch does (right after every arrival at that time,
    before anything else at it)."""
    own = stream.own
    feed: OpenLoopFeed | None = None
    if stream.trace_own is None:
        feed = OpenLoopFeed(engine, Intake(engine, _OwnArrivals(own)), own, stream.hints)
        stamps = _stamps(engine, own.times)
    else:
        _submit_trace(engine, stream.trace_own, stream.hints.tolist())
        stamps = np.maximum(_stamps(engine, own.times), 0.0)
    queue = Queue()
    due = [(k, t) for k, t in enumerate(readings) if t is not None]
    ended: list[Finished] = []
    next_feed = feed.next_time if feed is not None else math.inf
    while True:
        t_next = engine.next_event_time()
        if feed is not None and next_feed != math.inf and (t_next is None or next_feed <= t_next):
            next_feed = feed.feed()
            continue
        if due and (t_next is None or t_next >= due[0][1]):  # every event before it handled
            k, at = due.pop(0)
            waiting = engine.num_waiting() + int(np.count_nonzero(stamps == at))
            if k == 0:
                queue.at_mid = waiting
            else:
                queue.at_end = waiting
            continue
        if t_next is None:
            return queue
        before = min(next_feed, due[0][1]) if due else next_feed
        report = engine.run_until(before, folder.steps, ended)
        queue.peak = max(queue.peak, report.peak_waiting)
        if ended:
            folder.finished.extend(ended)
            ended.clear()
        folder.maybe_fold()
