"""One shard of a sharded session workload: sessions started by an open loop, routed by
``session_affinity``, so that each session's turns run on one replica.

Rule 1: why it is exact. An open loop draws every session's start and plan up front, in
        session order (``workload.sessions`` Rules 2 and 5), so they do not depend on the
        run; ``session_affinity`` sends session ``s`` to worker
        ``draw(router_seed, s) mod W`` whatever the replicas' state; and a turn is sent a
        think time after its previous answer ended, on the same replica. So a session's
        arrivals depend only on its own replica's progress: the shard draws every
        session's first turn, keeps its own sessions and runs them on its own replicas
        with the simulator's reactive loop (``sim.run``'s runs stopping after each event
        that completed a request, its follow-ups submitted at that time), each turn
        handed its session's worker; every request's times are the unsharded run's.
Rule 2: ``num_requests`` caps the turns of all sessions together, counted in the order
        the deployment sends them, which no shard sees: a workload whose sessions plan
        more turns than ``num_requests`` is refused (ConfigError) by the driver before
        any shard is sent (:func:`check_turn_cap`, from ``sim.fleet``), and by a shard
        given one all the same.
Rule 3: every turn of a session is submitted (or refused) on its own shard, so each
        shard counts its sessions' refusals and they add up; the session table is folded
        per turn index (requests, prompt and cached tokens, a TTFT sketch) and merged.
Rule 4: no capacity verdict: its queue readings are taken right after the deployment's
        last turn before the window's middle and right after its very last turn, times
        that depend on every shard's turns (``FleetInfo`` says so).

Who calls this: :func:`inference_lab.sim.shard.run_shard`, for a session workload.
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Mapping, Sequence

import attrs
import numpy as np

from inference_lab.core.config import Deployment, Workload
from inference_lab.core.engine import Engine, Finished
from inference_lab.errors import ConfigError
from inference_lab.sim.intake import Intake
from inference_lab.sim.shard_figures import (
    Folder,
    Queue,
    ShardJob,
    ShardResult,
    Stream,
    first_worker,
    owned_workers,
    shard_deployment,
    shard_result,
)
from inference_lab.sim.sharding import SessionFigures, ShardTiming, TurnFigures, route
from inference_lab.sim.sketch import QuantileSketch
from inference_lab.traffic.traces import Trace
from inference_lab.workload import make_generator
from inference_lab.workload.arrivals import Arrival, ArrivalArrays, ArrivalGenerator
from inference_lab.workload.sessions import SessionGenerator

__all__ = ["run_session_shard"]


class _OwnSessions(ArrivalGenerator):
    """The shard's sessions (Rule 1): their first turns, and what follows each turn as
    the workload's own generator answers it."""

    reactive = True
    has_content = True
    has_sessions = True

    def __init__(self, inner: SessionGenerator, first: list[Arrival]) -> None:
        self._inner = inner
        self._first = first

    def initial(self) -> list[Arrival]:
        return self._first

    def follow_up(self, arrival: Arrival, time: float, refused: bool) -> Arrival | None:
        return self._inner.follow_up(arrival, time, refused)


class _Turns:
    """The session table's figures, folded per turn index (Rule 3)."""

    def __init__(self) -> None:
        self.sessions: set[int] = set()
        self.requests: dict[int, int] = {}
        self.prompt: dict[int, int] = {}
        self.cached: dict[int, int] = {}
        self.ttft: dict[int, QuantileSketch] = {}

    def add(self, ended: Sequence[Finished], arrivals: Mapping[int, Arrival]) -> None:
        by_turn: dict[int, list[float]] = {}
        for f in ended:
            a = arrivals[f.request_id]
            self.sessions.add(a.session)
            k = a.turn
            self.requests[k] = self.requests.get(k, 0) + 1
            self.prompt[k] = self.prompt.get(k, 0) + f.prompt_tokens
            self.cached[k] = self.cached.get(k, 0) + f.cached_tokens
            by_turn.setdefault(k, []).append(f.first_token_time - f.arrival_time)
        for k, seconds in by_turn.items():
            # ms, as LatencyStats.from_seconds
            self.ttft.setdefault(k, QuantileSketch()).add(np.asarray(seconds) * 1e3)

    def figures(self, refused: Sequence[tuple[float, str]]) -> SessionFigures:
        return SessionFigures(
            sessions=len(self.sessions),
            by_turn=tuple(
                TurnFigures(
                    turn=k,
                    requests=self.requests[k],
                    ttft=self.ttft[k],
                    prompt_tokens=self.prompt[k],
                    cached_tokens=self.cached[k],
                )
                for k in sorted(self.requests)
            ),
            first_refusal_time=min((t for t, _ in refused), default=math.inf),
        )


def check_turn_cap(deployment: Deployment, workload: Workload | Trace, seed: int) -> None:
    """Rule 2, on the driver: a session workload (seeded with ``seed``) whose sessions
    plan more turns than its ``num_requests`` is refused (ConfigError, one line) before a
    shard is sent. Anything else passes; only a binding cap draws the sessions."""
    if not isinstance(workload, Workload) or workload.sessions is None:
        return
    if workload.num_requests is None:
        return
    generator = make_generator(workload, seed, _block_size(deployment))
    if isinstance(generator, SessionGenerator) and not generator.closed_loop:
        generator.initial()
        _check_cap(workload, generator)


def _block_size(deployment: Deployment) -> int | None:
    """The block size a session generator hashes prompts by (None: no prefix caching)."""
    sched = deployment.scheduler
    return sched.block_size if sched.enable_prefix_caching else None


def _check_cap(workload: Workload, generator: SessionGenerator) -> None:
    """Rule 2."""
    cap = workload.num_requests
    planned = generator.planned_turns()
    if cap is not None and cap < planned:
        raise ConfigError(
            f"--ray: num_requests ({cap:,}) caps the turns of all sessions together, in the "
            f"order the deployment sends them, which no shard sees; the sessions plan "
            f"{planned:,}: raise num_requests to at least that, or drop it"
        )


def run_session_shard(job: ShardJob) -> ShardResult:
    """Run ``job``'s shard of a session workload (module rules). Raises ConfigError for
    a workload the fleet would have refused, and for one whose cap binds (Rule 2)."""
    start, cpu = time.perf_counter(), time.process_time()
    engine = Engine(shard_deployment(job.deployment, len(job.replicas)))
    workload = job.workload
    assert isinstance(workload, Workload)
    generator = make_generator(workload, job.seed, _block_size(job.deployment))
    if not isinstance(generator, SessionGenerator) or generator.closed_loop:
        raise ConfigError("workload: a session shard runs sessions started by an open loop")
    first = generator.initial()
    _check_cap(workload, generator)
    owned = owned_workers(job)
    shift = first_worker(job)
    workers = route(job.deployment, np.array([a.session for a in first], np.int64)).tolist()
    worker_of = {a.session: w - shift for a, w in zip(first, workers, strict=True) if owned[w]}
    own = [a for a in first if a.session in worker_of]
    intake = Intake(engine, _OwnSessions(generator, own), route=lambda a: worker_of[a.session])
    select_cpu = time.process_time() - cpu
    folder = Folder(len(engine.workers), (math.inf, -math.inf))
    turns = _Turns()
    for arrival in own:
        intake.submit(arrival)
    peak = _loop(engine, intake, folder, turns)
    folder.fold()
    stream = Stream(ArrivalArrays(np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64)))
    times = np.array([a.time for a in first], np.float64)
    if len(times):
        stream.first, stream.last = float(times.min()), float(times.max())
    stream.count = len(first)
    for r in intake.refused:
        stream.refusals[r.limit] = stream.refusals.get(r.limit, 0) + 1
    stream.first_refusal = intake.refused[0].reason if intake.refused else ""
    timing = ShardTiming(
        wall_s=time.perf_counter() - start,
        cpu_s=time.process_time() - cpu,
        select_cpu_s=select_cpu,
        host=f"{socket.gethostname()}:{os.getpid()}",
    )
    result = shard_result(job, engine, stream, folder, Queue(peak=peak), timing)
    refused = [(r.arrival.time, r.reason) for r in intake.refused]
    submitted = len(intake.held) + len(intake.refused)  # (the turns it sent)
    return attrs.evolve(result, arrivals=submitted, sessions=turns.figures(refused))


def _loop(engine: Engine, intake: Intake, folder: Folder, turns: _Turns) -> int:
    """``sim.run``'s loop for a reactive workload with no observer but the folds: runs
    that stop after each event completing a request, whose follow-ups are then submitted
    at that time. Returns the shard's peak waiting queue."""
    ended: list[Finished] = []
    peak = 0
    while engine.next_event_time() is not None:
        report = engine.run_until(math.inf, folder.steps, ended, stop_on_finish=True)
        peak = max(peak, report.peak_waiting)
        if ended:
            turns.add(ended, intake.held)
            folder.finished.extend(ended)
            intake.on_finished(ended, engine.now)
            ended.clear()
        folder.maybe_fold()
    return peak
