"""What a shard of a sharded simulation is and reports, for both kinds of shard (an
arrival stream's: :mod:`inference_lab.sim.shard`; a session workload's:
:mod:`inference_lab.sim.shard_sessions`): the job, its figures, the folds of its records
into them (shard Rule 3) and the result built from them.

Pure figures: the shards' loops live in their own modules. The Rules cited are
:mod:`inference_lab.sim.shard`'s.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt

from inference_lab.core.config import Deployment, Workload
from inference_lab.core.engine import Engine
from inference_lab.sim.records import FinishedTable, StepTotals
from inference_lab.sim.sharding import SessionFigures, ShardTiming
from inference_lab.sim.sketch import QuantileSketch
from inference_lab.traffic.traces import Trace
from inference_lab.workload.arrivals import Arrival, ArrivalArrays
from inference_lab.workload.open_loop import ChunkMark

__all__ = [
    "FOLD_REQUESTS",
    "FOLD_STEPS",
    "LATENCIES",
    "Folder",
    "Queue",
    "ShardJob",
    "ShardResult",
    "Stream",
    "WorkerFigures",
    "first_worker",
    "owned_workers",
    "shard_deployment",
    "shard_result",
]

#: Completions kept before they are folded into sums and sketches (Rule 3).
FOLD_REQUESTS = 1 << 16
#: Steps' figures kept before they are folded into sums (Rule 3).
FOLD_STEPS = 1 << 18

#: The latencies a shard sketches, in the summary's order.
LATENCIES = ("ttft", "tpot", "e2e", "queue")


@attrs.frozen(kw_only=True)
class ShardJob:
    """One shard to run (Rule 1). ``replicas``: the deployment's replica indices it owns,
    in increasing order; ``counts_refusals``: whether it counts the requests that can
    never run (one shard of a run does)."""

    deployment: Deployment
    workload: Workload | Trace
    seed: int
    replicas: tuple[int, ...]
    counts_refusals: bool
    key: str


@attrs.frozen(kw_only=True)
class WorkerFigures:
    """One worker (the deployment's index) of a shard: requests completed there and its
    prefix-cache tokens."""

    worker: int
    requests: int
    query_tokens: int
    hit_tokens: int


@attrs.frozen(kw_only=True, eq=False)
class ShardResult:
    """What one shard reports (Rules 3-5): every figure a merge needs, none per request."""

    key: str
    replicas: tuple[int, ...]
    #: the whole stream's (Rule 4): every arrival, the first and last of every arrival,
    #: the first and last of those the deployment can run
    stream_arrivals: int
    first_arrival: float
    last_arrival: float
    first_offered: float
    last_offered: float
    #: the refusals by limit and the first one's reason (``counts_refusals`` only)
    refusals: tuple[tuple[str, int], ...]
    first_refusal: str
    #: this shard's arrivals and completions
    arrivals: int
    completed: int
    input_tokens: int
    output_tokens: int
    requests_hit: int
    last_finish: float
    latencies: dict[str, QuantileSketch]
    #: the capacity window's arrivals and completions of this shard
    offered_in_window: int
    served_in_window: int
    #: steps: count, sums and maximum of their figures, preemptions
    steps: int
    kv_usage_sum: float
    kv_usage_max: float
    flop_util_sum: float
    bw_util_sum: float
    preemptions: int
    prefix_caching: bool
    query_tokens: int
    hit_tokens: int
    workers: tuple[WorkerFigures, ...]
    #: Rule 5
    peak_waiting: int
    waiting_at_mid: int
    waiting_at_end: int
    sim_time_s: float  # the shard's engine clock at its last event
    timing: ShardTiming = ShardTiming()  # Rule 1: how long it took, and where
    #: a session workload's table and refusals (``sim.shard_sessions``); None otherwise
    sessions: SessionFigures | None = None


def shard_deployment(deployment: Deployment, replicas: int) -> Deployment:
    """``deployment`` with ``replicas`` replicas (the rest unchanged): a shard's own, and
    ``sim --replicas``'s."""
    return attrs.evolve(deployment, hardware=attrs.evolve(deployment.hardware, replicas=replicas))


@attrs.define
class Stream:
    """What the first pass over the arrival stream found (Rules 2 and 4)."""

    own: ArrivalArrays
    #: each own arrival's worker in the shard's deployment (the router's, shifted)
    hints: npt.NDArray[np.int32] = attrs.Factory(lambda: np.zeros(0, np.int32))
    #: a trace's own arrivals, in the trace's order (an open loop's are ``own``)
    trace_own: list[Arrival] | None = None
    count: int = 0
    first: float = math.inf
    last: float = -math.inf
    first_offered: float = math.inf
    last_offered: float = -math.inf
    refusals: dict[str, int] = attrs.Factory(dict)
    first_refusal: str = ""
    #: per chunk, the engine time of the last arrival that can run up to its end
    #: (-inf: none yet)
    chunk_last_stamp: array[float] = attrs.Factory(lambda: array("d"))
    #: every MARK_EVERY-th chunk's mark, to draw that part of the stream again
    marks: list[ChunkMark] = attrs.Factory(list)


def owned_workers(job: ShardJob) -> npt.NDArray[np.bool_]:
    dp = job.deployment.hardware.dp_attention
    owned = np.zeros(job.deployment.workers, dtype=np.bool_)
    for r in job.replicas:
        owned[r * dp : (r + 1) * dp] = True
    return owned


def first_worker(job: ShardJob) -> int:
    """The deployment's index of the shard's first worker (its workers are contiguous)."""
    return job.replicas[0] * job.deployment.hardware.dp_attention


class Folder:
    """The shard's records, folded into its figures whenever they grow past a fold
    (Rule 3)."""

    __slots__ = (
        "finished", "steps", "sketches", "window", "completed", "input_tokens",
        "output_tokens", "requests_hit", "last_finish", "served_in_window", "per_worker",
        "step_count", "kv_sum", "kv_max", "flop_sum", "bw_sum",
    )  # fmt: skip

    def __init__(self, workers: int, window: tuple[float, float]) -> None:
        self.finished = FinishedTable()
        self.steps = StepTotals()
        self.sketches = {name: QuantileSketch() for name in LATENCIES}
        self.window = window  # (mid, last]: the capacity window
        self.completed = self.input_tokens = self.output_tokens = self.requests_hit = 0
        self.last_finish = -math.inf
        self.served_in_window = 0
        self.per_worker = np.zeros(workers, dtype=np.int64)
        self.step_count = 0
        self.kv_sum = self.flop_sum = self.bw_sum = 0.0
        self.kv_max = 0.0

    def maybe_fold(self) -> None:
        """Fold when the records hold a fold's worth (after each run)."""
        if len(self.finished) >= FOLD_REQUESTS or len(self.steps) >= FOLD_STEPS:
            self.fold()

    def fold(self) -> None:
        """Fold what the records hold, then empty them."""
        if len(self.finished):
            self._fold_finished()
            self.finished.clear()
        if len(self.steps):
            self._fold_steps()
            self.steps.clear()

    def _fold_finished(self) -> None:
        """The summary's definitions (``summary.summarize``), on the records held."""
        col = self.finished.column
        arrival = col("arrival_time")
        first_token = col("first_token_time")
        finish = col("finish_time")
        output = col("output_tokens").astype(np.float64)
        multi = output > 1
        tpot = (finish[multi] - first_token[multi]) / (output[multi] - 1)
        for name, seconds in (
            ("ttft", first_token - arrival),
            ("tpot", tpot),
            ("e2e", finish - arrival),
            ("queue", col("first_scheduled_time") - arrival),
        ):
            self.sketches[name].add(seconds * 1e3)  # ms, as LatencyStats.from_seconds
        self.completed += len(arrival)
        self.input_tokens += int(col("prompt_tokens").sum())
        self.output_tokens += int((col("output_tokens") * col("n")).sum())
        self.requests_hit += int(np.count_nonzero(col("cached_tokens") > 0))
        self.last_finish = max(self.last_finish, float(finish.max()))
        mid, last = self.window
        self.served_in_window += int(np.count_nonzero((finish > mid) & (finish <= last)))
        self.per_worker += np.bincount(col("worker"), minlength=len(self.per_worker))

    def _fold_steps(self) -> None:
        col = self.steps.column
        kv = col("kv_usage")
        self.step_count += len(kv)
        self.kv_sum += float(kv.sum())
        self.kv_max = max(self.kv_max, float(kv.max()))
        self.flop_sum += float(col("flop_util").sum())
        self.bw_sum += float(col("bw_util").sum())


@attrs.define
class Queue:
    """The shard's queue figures (Rule 5)."""

    peak: int = 0
    at_mid: int = 0
    at_end: int = 0


def shard_result(
    job: ShardJob, engine: Engine, stream: Stream, folder: Folder, queue: Queue,
    timing: ShardTiming,
) -> ShardResult:  # fmt: skip
    """The shard's figures once its run is over."""
    stats = engine.statistics()
    owned = np.flatnonzero(owned_workers(job)).tolist()
    workers: Sequence[WorkerFigures] = [
        WorkerFigures(
            worker=owned[i],
            requests=int(folder.per_worker[i]),
            query_tokens=w.prefix_cache_queries,
            hit_tokens=w.prefix_cache_hits,
        )
        for i, w in enumerate(stats.workers)
    ]
    mid, last = folder.window
    own_times = stream.own.times
    return ShardResult(
        key=job.key,
        replicas=job.replicas,
        stream_arrivals=stream.count,
        first_arrival=stream.first,
        last_arrival=stream.last,
        first_offered=stream.first_offered,
        last_offered=stream.last_offered,
        refusals=tuple(sorted(stream.refusals.items())),
        first_refusal=stream.first_refusal,
        arrivals=len(own_times),
        completed=folder.completed,
        input_tokens=folder.input_tokens,
        output_tokens=folder.output_tokens,
        requests_hit=folder.requests_hit,
        last_finish=folder.last_finish,
        latencies=folder.sketches,
        offered_in_window=int(np.count_nonzero((own_times > mid) & (own_times <= last))),
        served_in_window=folder.served_in_window,
        steps=folder.step_count,
        kv_usage_sum=folder.kv_sum,
        kv_usage_max=folder.kv_max,
        flop_util_sum=folder.flop_sum,
        bw_util_sum=folder.bw_sum,
        preemptions=folder.steps.preempted,
        prefix_caching=stats.prefix_caching,
        query_tokens=stats.prefix_cache_queries,
        hit_tokens=stats.prefix_cache_hits,
        workers=tuple(workers),
        peak_waiting=queue.peak,
        waiting_at_mid=queue.at_mid,
        waiting_at_end=queue.at_end,
        sim_time_s=engine.now,
        timing=timing,
    )
