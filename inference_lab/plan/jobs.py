"""One planning job: a simulation of one deployment at one open-loop rate.

Rule 1: a `Job` holds everything its simulation reads (the resolved deployment, the
        workload with the probe's rate, request count and seed), never a path a worker
        must open: `run_job(job)` is a pure function of it and of the code, so a job gives
        the same `ProbeResult` on any worker, however often it is run or retried.
Rule 2: `Job.key` is the SHA-256 of the job's canonical JSON and `code_version()` (a hash
        of the sources a simulation runs); results are cached and shared under it.
Rule 3: a failure the inputs decide (a ConfigError or SimError: the workload cannot run
        here) is a result with `error` set, cached like any other; a worker that dies is
        not a result, the backend runs the job again.
Rule 4: `ProbeResult.wall_s` and `.worker` say how and where the job ran; nothing else in
        a result depends on it, and no decision of the planner reads them.
Rule 5: a disaggregated deployment's result also keeps `sim`'s own P/D figures
        (`PdFigures`, from `SimResult.disaggregation`): the mean of TTFT's four stages,
        each pool's busy share, the transfers' mean bytes and time; the report reads them
        to say why a split wins or loses.

Who calls this: the planner builds jobs (`make_job`); a backend runs `run_job` in-process,
in a pool worker or as a Ray task; `inference_lab.plan.cache` stores results.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from inference_lab.core.config import Deployment, Workload
from inference_lab.errors import InferenceLabError
from inference_lab.sim.disaggregation import DisaggregationSummary
from inference_lab.sim.itl import ItlRecorder
from inference_lab.sim.run import run_simulation
from inference_lab.sim.summary import RequestLatencies, request_latencies

__all__ = [
    "ITL_PERCENTILES",
    "Job",
    "PdFigures",
    "ProbeResult",
    "code_version",
    "make_job",
    "probe_workload",
    "run_job",
]

#: The ITL percentiles a result keeps (0, 0.1, ..., 100): inter-token gaps are one per
#: token, too many to keep, so an ITL SLO's percentile is a multiple of 0.1.
ITL_PERCENTILES: npt.NDArray[np.float64] = np.round(np.linspace(0.0, 100.0, 1001), 1)

_PACKAGE = Path(__file__).resolve().parent.parent
#: The sources a job's result depends on (Rule 2).
_CODE = ("core", "sim", "workload", "errors.py", "validation.py", "plan/jobs.py")


@functools.cache
def code_version() -> str:
    """A hash of the simulator's sources (the engine, the roofline, the configs, the sim
    loop, the workload generators and this module): a change to any of them gives every
    job a new key."""
    digest = hashlib.sha256()
    files: list[Path] = []
    for name in _CODE:
        path = _PACKAGE / name
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    for path in files:
        digest.update(path.relative_to(_PACKAGE).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def probe_workload(lengths: Workload, rate: float, requests: int, seed: int) -> Workload:
    """`lengths`' length distributions with `requests` Poisson arrivals at `rate` and
    `seed`: the workload of one probe (its arrival pattern and bounds are replaced)."""
    return attrs.evolve(
        lengths,
        arrival_pattern="poisson",
        arrival_rate=rate,
        num_concurrent_users=None,
        closed_loop_jitter_secs=0.0,
        num_requests=requests,
        duration_secs=None,
        seed=seed,
    )


def _canonical(value: Any) -> Any:
    if attrs.has(type(value)):
        return {
            a.name: _canonical(getattr(value, a.name))
            for a in attrs.fields(type(value))
            if a.name != "config_path"  # where the file was is not what it says
        }
    if isinstance(value, tuple | list):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    return value


@attrs.frozen(kw_only=True)
class Job:
    """One simulation to run (Rule 1); build it with `make_job`."""

    deployment: Deployment
    workload: Workload
    key: str

    @property
    def rate(self) -> float:
        return self.workload.arrival_rate


def make_job(deployment: Deployment, workload: Workload) -> Job:
    """The job for `deployment` under `workload`, with its key (Rule 2)."""
    doc = {
        "deployment": _canonical(deployment),
        "workload": _canonical(workload),
        "code": code_version(),
    }
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
    return Job(
        deployment=deployment,
        workload=workload,
        key=hashlib.sha256(text.encode()).hexdigest(),
    )


@attrs.frozen(kw_only=True)
class PdFigures:
    """A disaggregated probe's P/D figures, `sim`'s (Rule 5): TTFT's four stages (their
    means over the completed requests, ms: they add up to the mean TTFT), each pool's busy
    share (0-1), and the transfers' mean bytes and seconds."""

    queue_ms: float
    prefill_ms: float
    handoff_ms: float
    first_decode_ms: float
    prefill_busy: float
    decode_busy: float
    transfer_bytes: float
    transfer_s: float

    @classmethod
    def of(cls, summary: DisaggregationSummary) -> PdFigures:
        """The figures of `sim`'s summary of a run (no completed request: stages of 0)."""
        return cls(
            queue_ms=summary.ttft_queue.mean or 0.0,
            prefill_ms=summary.ttft_prefill.mean or 0.0,
            handoff_ms=summary.ttft_handoff.mean or 0.0,
            first_decode_ms=summary.ttft_first_decode.mean or 0.0,
            prefill_busy=summary.prefill.busy_share,
            decode_busy=summary.decode.busy_share,
            transfer_bytes=summary.transfer_bytes_mean,
            transfer_s=summary.transfer_seconds_mean,
        )


@attrs.frozen(kw_only=True, eq=False)
class ProbeResult:
    """What one job produced: counts, each completed request's latencies, the ITL
    percentiles on `ITL_PERCENTILES` (seconds; NaN when no request had two tokens), or the
    `error` that stopped it (Rule 3)."""

    key: str
    rate: float
    requests: int
    completed: int
    refused: int
    refusal: str  # the first refusal's reason, "" when none
    error: str  # "" unless the simulation could not run
    span_s: float
    latencies: RequestLatencies
    itl: npt.NDArray[np.float64]
    wall_s: float = 0.0  # Rule 4
    worker: str = ""  # Rule 4: host:pid
    pd: PdFigures | None = None  # Rule 5: a disaggregated deployment's

    def same_answer(self, other: ProbeResult) -> bool:
        """Everything but `wall_s` and `worker` is equal (Rule 4; tests use it)."""
        scalars = ("key", "rate", "requests", "completed", "refused", "refusal", "error", "pd")
        if any(getattr(self, n) != getattr(other, n) for n in scalars):
            return False
        arrays = [(self.itl, other.itl)] + [
            (getattr(self.latencies, n), getattr(other.latencies, n))
            for n in ("ttft", "tpot", "e2e", "queue", "output_tokens")
        ]
        return self.span_s == other.span_s and all(
            np.array_equal(a, b, equal_nan=True) for a, b in arrays
        )


def _itl_percentiles(itl: ItlRecorder) -> npt.NDArray[np.float64]:
    out = itl.percentiles(ITL_PERCENTILES)
    return np.full(ITL_PERCENTILES.size, np.nan) if out is None else out


def _empty_latencies() -> RequestLatencies:
    empty = np.zeros(0, dtype=np.float64)
    return RequestLatencies(
        ttft=empty, tpot=empty, e2e=empty, queue=empty, output_tokens=np.zeros(0, np.int64)
    )


def run_job(job: Job) -> ProbeResult:
    """Run `job`'s simulation (Rule 1). Never raises for a workload the deployment cannot
    run (Rule 3); any other exception is a bug and propagates to the backend."""
    start = time.perf_counter()
    worker = f"{socket.gethostname()}:{os.getpid()}"
    requests = job.workload.num_requests or 0
    itl = ItlRecorder()
    try:
        result = run_simulation(job.deployment, job.workload, on_events=itl.observe)
    except InferenceLabError as exc:
        return ProbeResult(
            key=job.key,
            rate=job.rate,
            requests=requests,
            completed=0,
            refused=0,
            refusal="",
            error=str(exc),
            span_s=0.0,
            latencies=_empty_latencies(),
            itl=np.full(ITL_PERCENTILES.size, np.nan),
            wall_s=time.perf_counter() - start,
            worker=worker,
        )
    return ProbeResult(
        key=job.key,
        rate=job.rate,
        requests=requests,
        completed=result.summary.requests_completed,
        refused=result.summary.requests_refused,
        refusal=result.refused[0].reason if result.refused else "",
        error="",
        span_s=result.summary.span_s,
        latencies=request_latencies(result.finished),
        itl=_itl_percentiles(itl),
        wall_s=time.perf_counter() - start,
        worker=worker,
        pd=None if result.disaggregation is None else PdFigures.of(result.disaggregation),
    )
