"""The offline simulation behind `inference-lab sim`: a workload through the engine, as fast
as the CPU allows.

Rule 1: the simulation is `run_simulation`, a plain loop over `Engine.step()` (or
        `Engine.run_until`, Rule 7); it is the only
        place that reads the wall clock (to report real time) and it does constant work per
        engine event (recording the step and the completions, telling the observers), so
        the engine's own cost dominates. The loop asks the engine for its next event in one
        place (`Engine.next_event_time`, at the top of `_drive`).
Rule 2: open-loop arrivals run as if all were submitted before the first step: they are
        drawn as arrays and fed to the engine in chunks as the loop reaches them
        (`inference_lab.sim.intake`, Rule 2); a closed-loop user's next request is
        submitted at its previous request's finish time, from the `step()` that reported
        the completion.
Rule 3: every request runs to its sampled length; a request the deployment can never run is
        counted apart (`inference_lab.sim.intake`, Rule 1).
Rule 4: `max_waiting` bounds the waiting places as serve's admission does
        (`inference_lab.sim.observers.WaitingBound`): an arrival refused so is aborted
        before any step sees it, and a closed-loop user refused so sends its next request
        when the next request finishes, never at the same instant.
Rule 5: requests carry block hashes only when the deployment caches prefixes (the
        generator is given the block size); the prefix-cache figures come from the
        engine's counters at the end of the run and the `Finished` records.
Rule 6: what watches the run is an observer (`inference_lab.sim.observers`): the waiting
        queue and the capacity verdict, the `max_waiting` bound, the sampled time series
        (`SeriesRecorder`, with `series_interval`) and progress; an `on_events` callback
        sees every event after them.
Rule 7: when every observer takes runs and there is no `on_events` callback, the events
        before the next feed are handled as one run (`Engine.run_until`: the same work in
        the same order as a `step()` each, the steps' figures written to the step totals,
        pure decode steps taken by the fast path's decode runs); a reactive workload's run
        stops after each event that completed a request, so its follow-ups are submitted
        at the completion's time, as one by one; the queue figures come from the run's
        report, which reads them after each arrival.
Rule 8: what the run keeps grows by a few numbers per request and per step, never by an
        object: completions and step figures go to compact columns
        (`inference_lab.sim.records`); an open loop's arrivals stay arrays, and an
        `Arrival` is built only when one is asked for.

Dependencies: config -> engine -> this module -> `sim/cli.py` (the `inference-lab sim`
command, which prints and writes what `inference_lab.sim.text` formats).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from inference_lab.core.config import Deployment, Workload
from inference_lab.core.engine import Engine, EngineStatistics, Finished, RunReport, StepEvents
from inference_lab.errors import ConfigError, SimError
from inference_lab.sim.capacity import CapacityVerdict
from inference_lab.sim.disaggregation import DisaggregationSummary, disaggregation_summary
from inference_lab.sim.intake import Intake, OpenLoopFeed, open_loop_feed
from inference_lab.sim.lora import LoraSummary, lora_summary
from inference_lab.sim.observers import (
    Progress,
    ProgressMeter,
    QueueWatch,
    RunObserver,
    WaitingBound,
)
from inference_lab.sim.records import QUEUE_LIMIT, FinishedTable, Refused, StepTotals
from inference_lab.sim.series import Series, SeriesRecorder
from inference_lab.sim.sharding import FleetInfo
from inference_lab.sim.summary import (
    PrefixCacheSummary,
    ReplicaSummary,
    SessionSummary,
    SimSummary,
    SpeculativeSummary,
    prefix_cache_summary,
    replica_summaries,
    session_summary,
    speculative_summary,
    summarize,
)
from inference_lab.sim.tiers import TierSummary, tier_summary
from inference_lab.traffic.traces import Trace
from inference_lab.workload import make_generator
from inference_lab.workload.adapters import AdapterPicker
from inference_lab.workload.arrivals import Arrival, ArrivalGenerator

__all__ = [
    "Progress",
    "Refused",
    "SimError",
    "SimResult",
    "run_simulation",
]


@attrs.frozen(kw_only=True)
class SimResult:
    """Everything one simulation produced."""

    summary: SimSummary
    finished: Sequence[Finished]  # in completion order (compact: `records.FinishedTable`)
    refused: tuple[Refused, ...]
    sim_time_s: float  # engine clock at the end (the last event)
    wall_time_s: float  # real seconds spent in the loop (submits included)
    peak_waiting: int  # largest waiting queue seen after an arrival or a preemption
    seed: int  # the seed the arrivals were drawn with
    #: Open loop: whether the deployment kept up (`inference_lab.sim.capacity`); None for
    #: a closed loop or a window too short to judge.
    capacity: CapacityVerdict | None = None
    arrivals: Mapping[int, Arrival] = attrs.field(factory=dict)  # request id -> its arrival
    prefix_cache: PrefixCacheSummary | None = None
    replicas: tuple[ReplicaSummary, ...] = ()
    sessions: SessionSummary | None = None
    #: whether the workload's requests said anything about their content (hashes)
    has_content: bool = False
    #: the sampled series (Rule 6), when asked for
    series: Series | None = None
    #: speculative decoding's figures, when the deployment speculates
    speculative: SpeculativeSummary | None = None
    #: a disaggregated deployment's pools, transfers and TTFT stages
    disaggregation: DisaggregationSummary | None = None
    #: the KV tiers behind HBM, when the deployment has them
    tiers: TierSummary | None = None
    #: the LoRA adapters, when the deployment serves them
    lora: LoraSummary | None = None
    #: a sharded run's shards and what of it is not exact (`inference_lab.sim.fleet`)
    fleet: FleetInfo | None = None

    def to_dict(self) -> dict[str, Any]:
        """The summary sections of `sim -o`'s JSON, plus the peak queue, the capacity
        verdict and the times."""
        out = self.summary.to_dict()
        if self.prefix_cache is not None:
            out["prefix_cache"] = self.prefix_cache.to_dict()
        out["replicas"] = [r.to_dict() for r in self.replicas]
        if self.sessions is not None:
            out["sessions"] = self.sessions.to_dict()
        if self.speculative is not None:
            out["speculative"] = self.speculative.to_dict()
        if self.disaggregation is not None:
            out["disaggregation"] = self.disaggregation.to_dict()
        if self.tiers is not None:
            out["kv_tiers"] = self.tiers.to_dict()
        if self.lora is not None:
            out["lora"] = self.lora.to_dict()
        out["peak_waiting"] = self.peak_waiting
        if self.fleet is not None:
            out["fleet"] = self.fleet.to_dict()
        out["capacity"] = None if self.capacity is None else self.capacity.to_dict()
        out["time"] = {
            "simulated_s": self.sim_time_s,
            "wall_s": self.wall_time_s,
            "speedup": self.sim_time_s / self.wall_time_s if self.wall_time_s > 0 else None,
        }
        return out


def _adapters(engine: Engine, workload: Workload | Trace, seed: int | None) -> AdapterPicker | None:
    """The run's adapter draws (``[adapters]``; None: every request is the base model's).
    ConfigError when the workload names adapters the deployment does not serve."""
    if not isinstance(workload, Workload) or workload.adapters is None:
        return None
    mix = workload.adapters
    served = () if engine.adapters is None else tuple(engine.adapters.by_name)
    return AdapterPicker(mix, served, workload.seed if seed is None else seed)


def run_simulation(
    deployment: Deployment,
    workload: Workload | Trace,
    seed: int | None = None,
    progress: Callable[[Progress], None] | None = None,
    series_interval: float | None = None,
    on_events: Callable[[StepEvents], None] | None = None,
) -> SimResult:
    """Run `workload` (seeded with `seed` if given, else its own seed), or replay a trace,
    on a fresh engine for `deployment` until every request has finished or been refused;
    with `series_interval`, sample the run every that many simulated seconds (Rule 6).

    `on_events`, when given, sees every `StepEvents` the engine returns, in order (the
    planner's inter-token latencies are measured from them).

    Raises ConfigError for an unusable workload and SimError for one that cannot progress.
    """
    wall_start = time.perf_counter()
    engine = Engine(deployment)
    sched = deployment.scheduler
    generator = make_generator(
        workload, seed, sched.block_size if sched.enable_prefix_caching else None
    )
    adapters = _adapters(engine, workload, seed)
    intake = Intake(engine, generator, adapters)
    feed = open_loop_feed(engine, intake, generator)  # Rule 2
    initial = generator.initial() if feed is None else []
    times = feed.times if feed is not None else np.array([a.time for a in initial], np.float64)
    watch = QueueWatch(engine, times, generator.closed_loop)
    for arrival in initial:
        intake.submit(arrival)
    finished = FinishedTable(disaggregated=deployment.disaggregation is not None)
    steps = StepTotals(speculative=deployment.speculative is not None)
    recorder = SeriesRecorder(series_interval, engine) if series_interval is not None else None
    limiter = _waiting_bound(deployment, engine, intake, recorder)
    total = generator.total
    meter = ProgressMeter(progress, engine, (steps, finished), intake, total) if progress else None
    observers = [o for o in (limiter, watch, recorder, meter) if o is not None]
    _drive(engine, intake, feed, generator, (steps, finished), observers, watch, on_events)
    if meter is not None:
        meter.finish()

    stats: EngineStatistics = engine.statistics()
    summary = summarize(
        finished,
        steps,
        refused=len(intake.refused),
        first_arrival=intake.first_arrival if intake.first_arrival != math.inf else None,
    )
    return SimResult(
        summary=summary,
        finished=finished,
        refused=tuple(intake.refused),
        sim_time_s=engine.now,
        wall_time_s=time.perf_counter() - wall_start,
        peak_waiting=watch.peak,
        seed=generator.seed,
        arrivals=intake.arrivals,
        prefix_cache=prefix_cache_summary(stats, finished),
        replicas=replica_summaries(stats, finished),
        sessions=session_summary(finished, intake.arrivals) if generator.has_sessions else None,
        has_content=generator.has_content,
        capacity=_capacity(generator, feed, initial, intake, watch, limiter, finished),
        series=recorder.finish(engine.now, engine) if recorder is not None else None,
        speculative=(speculative_summary(steps) if deployment.speculative is not None else None),
        disaggregation=(
            disaggregation_summary(deployment, stats, finished, summary.span_s)
            if deployment.disaggregation is not None
            else None
        ),
        tiers=tier_summary(stats),
        lora=lora_summary(stats, adapters),
    )


def _waiting_bound(
    deployment: Deployment, engine: Engine, intake: Intake, recorder: SeriesRecorder | None
) -> WaitingBound | None:
    """Rule 4: the ``max_waiting`` bound's observer (None: unbounded). ConfigError with
    ``[disaggregation]``, where serve applies the bound per role."""
    max_waiting = deployment.scheduler.max_waiting
    if max_waiting and deployment.disaggregation is not None:
        raise ConfigError(
            f"{deployment.config_path}: max_waiting with [disaggregation] is not simulated "
            "(serve applies it per role: docs/disaggregation.md)"
        )
    if not max_waiting:  # 0: unbounded
        return None
    on_refused = recorder.refused if recorder is not None else None
    return WaitingBound(engine, max_waiting, intake, on_refused)


def _drive(
    engine: Engine,
    intake: Intake,
    feed: OpenLoopFeed | None,
    generator: ArrivalGenerator,
    records: tuple[StepTotals, FinishedTable],
    observers: Sequence[RunObserver],
    watch: QueueWatch,
    on_events: Callable[[StepEvents], None] | None,
) -> None:
    """The loop (Rules 1, 2, 6, 7): until the engine has no event left, feed the open
    loop's arrivals that are due, then handle the events before the next feed as a run
    where the observers allow it, else step the next event; record what it did and tell
    the observers."""
    inf = math.inf
    next_event_time = engine.next_event_time
    step = engine.step
    add_step = records[0].add
    add_finished = records[1].extend
    on_finished = intake.on_finished if generator.reactive else None
    hooks = [o.on_step for o in observers] + ([on_events] if on_events is not None else [])
    run_hooks = [o.on_run for o in observers]
    due = min((o.due for o in observers), default=inf)
    takes_runs = on_events is None and all(o.takes_runs for o in observers)
    mid_arrival = watch.mid_arrival
    ended: list[Finished] = []
    next_feed = feed.next_time if feed is not None else inf
    while True:
        t_next = next_event_time()  # the one place the loop asks for the next event
        if next_feed != inf and (t_next is None or next_feed <= t_next):
            assert feed is not None
            next_feed = feed.feed()  # Rule 2: before an event past the next arrival
            continue
        if t_next is None:
            break
        if takes_runs:  # Rule 7
            _take_run(engine, next_feed, records, ended, mid_arrival, on_finished, run_hooks)
            continue
        if t_next >= due:
            due = _before_step(observers, t_next)
        ev = step()
        info = ev.step
        if info is not None:
            add_step(info)
        if ev.finished:
            add_finished(ev.finished)
            if on_finished is not None:
                on_finished(ev.finished, ev.time)
        for hook in hooks:
            hook(ev)


def _take_run(
    engine: Engine,
    until: float,
    records: tuple[StepTotals, FinishedTable],
    ended: list[Finished],
    mid_arrival: float,
    on_finished: Callable[[Sequence[Finished], float], None] | None,
    run_hooks: Sequence[Callable[[RunReport], None]],
) -> None:
    """Rule 7: the events before ``until`` as one run (the steps' figures written to the
    step totals); its completions recorded and, for a reactive workload, followed up at
    the run's end; then the observers told. ``_drive`` calls it; ``ended`` is its
    scratch list, left empty."""
    table = records[1]
    report = engine.run_until(
        until,
        records[0],
        ended,
        mid=mid_arrival,
        stop_on_finish=on_finished is not None,
        record=None if on_finished is not None or table.disaggregated else table.add_fields,
    )
    if ended:
        records[1].extend(ended)
        if on_finished is not None:
            on_finished(ended, engine.now)
        ended.clear()
    for run_hook in run_hooks:
        run_hook(report)


def _before_step(observers: Sequence[RunObserver], t_next: float) -> float:
    """The observers whose ``due`` time the next event (at ``t_next``) reaches are told
    before it; returns the next ``due`` time. ``_drive`` calls it."""
    for o in observers:
        if t_next >= o.due:
            o.before_step(t_next)
    return min(o.due for o in observers)


def _capacity(
    generator: ArrivalGenerator,
    feed: OpenLoopFeed | None,
    initial: Sequence[Arrival],
    intake: Intake,
    watch: QueueWatch,
    limiter: WaitingBound | None,
    finished: FinishedTable,
) -> CapacityVerdict | None:
    """The capacity verdict of an open loop (`inference_lab.sim.capacity`), None for a
    closed one: over the arrivals offered, those the deployment can never run left out."""
    if generator.closed_loop:
        return None
    if feed is not None:
        offered = np.delete(feed.times, feed.never_fit)
    else:
        unfit = {id(r.arrival) for r in intake.refused if r.limit != QUEUE_LIMIT}
        offered = np.array([a.time for a in initial if id(a) not in unfit], np.float64)
    rejected = limiter.rejected_at if limiter is not None else []
    return watch.verdict(offered, finished.column("finish_time"), rejected)
