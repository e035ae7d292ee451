"""A sharded simulation (``inference-lab sim --ray``): a deployment's replicas split into
shards, each run as a job on an executor, their figures merged into one summary.

Rule 1: a deployment is sharded only when its replicas can be simulated apart
        (:mod:`inference_lab.sim.sharding`: a router that reads no replica -- round
        robin, random, session affinity --, an open loop or a trace, or sessions under
        session affinity, no ``max_waiting``, no speculation); anything else is one
        line, before any job runs.
Rule 2: shard ``j`` of ``K`` owns replicas ``[j * N // K, (j + 1) * N // K)``; shard 0
        counts the requests that can never run (:mod:`inference_lab.sim.shard`, Rule 4).
        Jobs are pure (shard Rule 1): the answer does not depend on the executor, on the
        number of workers or on the order the results come back.
Rule 3: the merge is exact for every count and integer sum (requests, tokens, steps,
        preemptions, each worker's requests and prefix-cache tokens), for the minima,
        maxima, the span, the rates, the simulated time and the capacity verdict (its
        queue readings too: shard Rule 5); the means of the latencies and of the steps'
        utilisations are sums of the shards' sums (exact up to floating-point rounding);
        the percentiles come from merged quantile sketches, within
        :data:`~inference_lab.sim.sketch.RELATIVE_ACCURACY` (relative) of the unsharded
        run's (:mod:`inference_lab.sim.sketch`).
Rule 4: the peak waiting queue is the sum of the shards' peaks: an upper bound of the
        run's, as the replicas need not peak together (``FleetInfo`` says so).
Rule 5: ``sim --ray HOST:PORT`` first connects to that port (the head's GCS, or a Ray
        client server for ``ray://``) with a timeout of :data:`PROBE_TIMEOUT_S`: where
        nothing listens it fails in one line within that time, before ``ray.init`` (which
        would keep retrying the GCS for a minute or more).
Rule 6: a session workload (``sim.shard_sessions``): every shard counts its own
        sessions' refusals, so they are summed; the session table is merged per turn
        (counts and sums exactly, TTFT percentiles from merged sketches); no capacity
        verdict (its queue readings follow the deployment's last turns, which no shard
        sees).

Who calls this: ``sim/cli.py`` (``--ray``), tests (with the in-process executor) and
``scripts/bench_fleet.py``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import attrs

from inference_lab.core.config import Deployment, Workload
from inference_lab.errors import SimError
from inference_lab.executors.backends import Executor, JobFailure
from inference_lab.executors.ray_backend import PROBE_TIMEOUT_S, NoClusterThere
from inference_lab.executors.ray_backend import probe_address as probe_ray_address
from inference_lab.sim.capacity import judge_capacity
from inference_lab.sim.records import FinishedTable
from inference_lab.sim.run import SimResult
from inference_lab.sim.shard import LATENCIES, ShardJob, ShardResult, run_shard
from inference_lab.sim.shard_sessions import check_turn_cap
from inference_lab.sim.sharding import FleetInfo, TurnFigures, check_shardable
from inference_lab.sim.sketch import RELATIVE_ACCURACY, QuantileSketch
from inference_lab.sim.summary import (
    PrefixCacheSummary,
    ReplicaSummary,
    SessionSummary,
    SimSummary,
    TurnStats,
)
from inference_lab.traffic.traces import Trace

__all__ = [
    "PROBE_TIMEOUT_S",
    "merge_shards",
    "probe_address",
    "run_fleet",
    "run_on_ray",
    "shard_jobs",
]


def shard_jobs(
    deployment: Deployment, workload: Workload | Trace, seed: int, shards: int
) -> list[ShardJob]:
    """The jobs of a run in ``shards`` shards (Rule 2; at most one per replica)."""
    n = deployment.hardware.replicas
    k = max(1, min(shards, n))
    return [
        ShardJob(
            deployment=deployment,
            workload=workload,
            seed=seed,
            replicas=tuple(range(j * n // k, (j + 1) * n // k)),
            counts_refusals=j == 0,
            key=f"shard {j + 1} of {k}",
        )
        for j in range(k)
    ]


def run_fleet(
    deployment: Deployment,
    workload: Workload | Trace,
    executor: Executor[ShardJob, ShardResult],
    *,
    seed: int | None = None,
    shards: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> SimResult:
    """Run ``workload`` (seeded with ``seed``, else its own) on ``deployment`` in
    ``shards`` shards (default: the executor's parallelism) and merge them (module
    rules); ``progress(done, total)`` after each shard. Raises ConfigError when it cannot
    be sharded, SimError when a shard fails (its executor's reason)."""
    start = time.perf_counter()
    check_shardable(deployment, workload)
    run_seed = _run_seed(workload, seed)
    check_turn_cap(deployment, workload, run_seed)
    jobs = shard_jobs(deployment, workload, run_seed, shards or executor.parallelism)
    for job in jobs:
        executor.submit(job)
    results: dict[str, ShardResult] = {}
    for job, outcome in executor.results():
        if isinstance(outcome, JobFailure):
            raise SimError(f"{job.key} ({len(job.replicas)} replicas) failed: {outcome.message}")
        results[job.key] = outcome
        if progress is not None:
            progress(len(results), len(jobs))
    ordered = [results[job.key] for job in jobs]
    merged = merge_shards(
        ordered,
        deployment=deployment,
        seed=run_seed,
        wall_s=time.perf_counter() - start,
        parallelism=executor.parallelism,
    )
    # whether the requests said anything about their content, as the generator says
    content = workload.has_content if isinstance(workload, Trace) else workload.sessions is not None
    return attrs.evolve(merged, has_content=content)


def _run_seed(workload: Workload | Trace, seed: int | None) -> int:
    """The seed a run draws with: ``seed``, else the workload's own (a trace's is 0, as
    its generator says)."""
    if isinstance(workload, Workload):
        return workload.seed if seed is None else seed
    return 0


def run_on_ray(
    address: str,
    deployment: Deployment,
    workload: Workload | Trace,
    *,
    seed: int | None = None,
    shards: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> SimResult:
    """:func:`run_fleet` on Ray (``sim --ray ADDRESS``: ``local``, ``auto`` or a cluster
    address; the executors' ``ray_backend`` Rule 3): refused before Ray starts when it
    cannot be sharded; the executor is closed however the run ends."""
    check_shardable(deployment, workload)
    check_turn_cap(deployment, workload, _run_seed(workload, seed))
    probe_address(address)
    from inference_lab.executors.ray_backend import RayExecutor

    try:
        executor: RayExecutor[ShardJob, ShardResult] = RayExecutor(run_shard, address)
    except (ValueError, ConnectionError, RuntimeError) as exc:  # ray.init's
        lines = str(exc).strip().splitlines()
        raise SimError(f"--ray {address}: {lines[0] if lines else type(exc).__name__}") from exc
    try:
        return run_fleet(
            deployment, workload, executor, seed=seed, shards=shards, progress=progress
        )
    finally:
        executor.close()


def probe_address(address: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Raise SimError, one line naming ``address``, unless something accepts a TCP
    connection at its ``host:port`` within ``timeout`` seconds (Rule 5: the executors'
    ``ray_backend.probe_address``). ``local``, ``auto`` and an address without a port are
    left to ``ray.init``."""
    try:
        probe_ray_address(address, timeout)
    except NoClusterThere as exc:
        raise SimError(str(exc)) from None


def _latency_sketches(results: Sequence[ShardResult]) -> dict[str, QuantileSketch]:
    merged = {name: QuantileSketch() for name in LATENCIES}
    for r in results:
        for name in LATENCIES:
            merged[name].merge(r.latencies[name])
    return merged


def _summary(results: Sequence[ShardResult], refused: int) -> SimSummary:
    """The summary's figures from the shards' (Rule 3), as ``summary.summarize`` defines
    them."""
    sketches = _latency_sketches(results)
    completed = sum(r.completed for r in results)
    first = results[0].first_arrival
    span = max(max(r.last_finish for r in results) - first, 0.0) if completed else 0.0
    input_tokens = sum(r.input_tokens for r in results)
    output_tokens = sum(r.output_tokens for r in results)
    steps = sum(r.steps for r in results)

    def rate(x: float) -> float:
        return x / span if span > 0 else 0.0

    def mean(total: float) -> float:
        return total / steps if steps else 0.0

    return SimSummary(
        requests_submitted=completed + refused,
        requests_completed=completed,
        requests_refused=refused,
        ttft=sketches["ttft"].stats(),
        tpot=sketches["tpot"].stats(),
        e2e=sketches["e2e"].stats(),
        queue=sketches["queue"].stats(),
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        span_s=span,
        input_tokens_per_s=rate(input_tokens),
        output_tokens_per_s=rate(output_tokens),
        requests_per_s=rate(completed),
        steps=steps,
        kv_usage_mean=mean(math.fsum(r.kv_usage_sum for r in results)),
        kv_usage_max=max(r.kv_usage_max for r in results),
        flop_util_mean=mean(math.fsum(r.flop_util_sum for r in results)),
        bw_util_mean=mean(math.fsum(r.bw_util_sum for r in results)),
        preemptions=sum(r.preemptions for r in results),
    )


def merge_shards(
    results: Sequence[ShardResult],
    *,
    deployment: Deployment,
    seed: int,
    wall_s: float,
    parallelism: int = 1,
) -> SimResult:
    """One run's result from its shards' (in shard order; Rules 3 and 4)."""
    if not results:
        raise ValueError("no shard to merge")
    head = results[0]
    counting = [r for r in results if r.refusals]
    refusals = counting[0].refusals if counting else ()
    first_refusal = counting[0].first_refusal if counting else ""
    if head.sessions is not None:  # each shard counts its own sessions' (Rule 6)
        refusals, first_refusal = _session_refusals(results)
    summary = _summary(results, sum(count for _, count in refusals))
    workers = sorted((w for r in results for w in r.workers), key=lambda w: w.worker)
    capacity = None
    if head.sessions is None and head.last_offered >= head.first_offered:  # (some could run)
        capacity = judge_capacity(
            head.first_offered,
            head.last_offered,
            offered=sum(r.offered_in_window for r in results),
            served=sum(r.served_in_window for r in results),
            rejected=0,
            waiting_at_mid=sum(r.waiting_at_mid for r in results),
            waiting_at_end=sum(r.waiting_at_end for r in results),
        )
    return SimResult(
        summary=summary,
        finished=FinishedTable(),  # (none kept: shard Rule 3)
        refused=(),
        sim_time_s=max(r.sim_time_s for r in results),
        wall_time_s=wall_s,
        peak_waiting=sum(r.peak_waiting for r in results),
        seed=seed,
        capacity=capacity,
        prefix_cache=PrefixCacheSummary(
            enabled=head.prefix_caching,
            query_tokens=sum(r.query_tokens for r in results),
            hit_tokens=sum(r.hit_tokens for r in results),
            requests=summary.requests_completed,
            requests_hit=sum(r.requests_hit for r in results),
        ),
        replicas=tuple(
            ReplicaSummary(
                replica=w.worker,
                requests=w.requests,
                query_tokens=w.query_tokens,
                hit_tokens=w.hit_tokens,
            )
            for w in workers
        ),
        sessions=_sessions(results) if head.sessions is not None else None,
        fleet=FleetInfo(
            replicas=deployment.hardware.replicas,
            shards=len(results),
            parallelism=parallelism,
            relative_accuracy=RELATIVE_ACCURACY,
            timings=tuple(r.timing for r in results),
            refusals=refusals,
            first_refusal=first_refusal,
        ),
    )


def _session_refusals(
    results: Sequence[ShardResult],
) -> tuple[tuple[tuple[str, int], ...], str]:
    """A session run's refusals by limit, summed over the shards (Rule 6), and the reason
    of the earliest arriving one (the first shard's on a tie)."""
    counts: dict[str, int] = {}
    for r in results:
        for limit, count in r.refusals:
            counts[limit] = counts.get(limit, 0) + count
    first = min(
        (r for r in results if r.refusals),
        key=lambda r: r.sessions.first_refusal_time if r.sessions is not None else math.inf,
        default=None,
    )
    return tuple(sorted(counts.items())), first.first_refusal if first is not None else ""


def _sessions(results: Sequence[ShardResult]) -> SessionSummary:
    """The session table from the shards' (Rule 6): counts and sums added, each turn's
    TTFT from the merged sketches."""
    figures = [r.sessions for r in results if r.sessions is not None]
    turns: dict[int, list[TurnFigures]] = {}
    for f in figures:
        for t in f.by_turn:
            turns.setdefault(t.turn, []).append(t)
    by_turn = []
    for k, parts in sorted(turns.items()):
        ttft = QuantileSketch()
        for t in parts:
            ttft.merge(t.ttft)
        by_turn.append(
            TurnStats(
                turn=k,
                requests=sum(t.requests for t in parts),
                ttft=ttft.stats(),
                prompt_tokens=sum(t.prompt_tokens for t in parts),
                cached_tokens=sum(t.cached_tokens for t in parts),
            )
        )
    requests = sum(t.requests for t in by_turn)
    return SessionSummary(
        sessions=sum(f.sessions for f in figures), turns=requests, by_turn=tuple(by_turn)
    )
