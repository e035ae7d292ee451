"""The offline simulation behind `inference-lab sim`: a workload through the engine, as fast
as the CPU allows, and the text, JSON and CSV that describe the run.

Rule 1: the simulation is `run_simulation`, a plain loop over `Engine.step()`; it is the only
        place that reads the wall clock (to report real time) and it does constant work per
        engine event (appending the step / completions, a counter for progress), so the
        engine's own cost dominates.
Rule 2: open-loop arrivals run as if all were submitted before the first step (the
        engine's event heap orders them): they are drawn as arrays and fed to the engine in
        chunks of FEED_CHUNK, in arrival order, each chunk before the engine handles an
        event later than its first arrival, filed in the heap as submitted up front
        (the engine's Rule 11); a closed-loop user's next request is submitted at its
        previous request's finish time, from the `step()` that reported the completion.
Rule 3: every request is submitted with `max_tokens = target = ` the sampled output length, so
        it runs to its sampled length and finishes with reason `length`; a request the
        deployment can never run (`RequestRefused`) is counted apart and, in a closed loop,
        its user moves straight on to its next request (a session's refused turn ends the
        session).
Rule 4: `max_waiting` bounds the waiting places as serve's admission does
        (`inference_lab.core.admission`): an arrival that has no seat in its replica's
        batch and finds `max_waiting` waiting places taken is refused when the engine
        handles it (limit `max_waiting`, serve's 529) and aborted before any step sees it.
        A closed-loop user refused so sends its next request when the next request
        finishes (the first moment the queue can have moved), never at the same instant.
Rule 5: requests carry block hashes only when the deployment caches prefixes (the
        generator is given the block size); the prefix-cache figures come from the
        engine's counters at the end of the run and the `Finished` records.
Rule 6: with `series_interval`, a `SeriesRecorder` (`inference_lab.sim.series`) samples the
        run at that interval of simulated time: constant work per event and one point per
        interval, never a row per step.
Rule 7: without a waiting-queue bound, a recorder or an `on_events` callback, the arrivals
        at the head of the engine's queue are handled as one run (`Engine.take_arrivals`,
        the same work in the same order as a `step()` each); a run stops at the next feed
        and at the middle of the arrival window, so the queue figures read after it are
        those read after its last arrival one by one.
Rule 7: what the run keeps grows by a few numbers per request and per step, never by an
        object: completions and step figures go to compact columns
        (`inference_lab.sim.records`); an open loop's arrivals stay arrays, and an
        `Arrival` is built only when one is asked for.

Dependencies: config -> engine -> this module -> `sim_cli` (the `inference-lab sim` command,
which prints and writes what the functions of this module's second half format).
"""

from __future__ import annotations

import csv
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

import attrs
import numpy as np

from inference_lab.core.admission import Admission
from inference_lab.core.builders import frozen_builder
from inference_lab.core.config import Deployment, Workload
from inference_lab.core.engine import (
    Engine,
    EngineStatistics,
    Finished,
    RequestSpec,
    StepEvents,
)
from inference_lab.errors import RequestRefused, SimError
from inference_lab.sim.capacity import CapacityVerdict, assess_capacity
from inference_lab.sim.records import ArrivalTable, FinishedTable, StepTotals
from inference_lab.sim.series import Series, SeriesRecorder
from inference_lab.sim.summary import (
    LATENCY_COLUMNS,
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
from inference_lab.sim.workload import Arrival, OpenLoopGenerator, make_generator
from inference_lab.traffic.traces import Trace

__all__ = [
    "Progress",
    "Refused",
    "SimError",
    "SimResult",
    "config_dict",
    "format_config",
    "format_summary",
    "run_simulation",
    "write_request_csv",
]

#: Progress is reported every this many engine events (and once at the end).
PROGRESS_EVERY = 256
#: A closed loop whose users are refused this many times in a row without one admitted
#: request would spin forever at one simulated instant; it is reported as an error instead.
MAX_REFUSAL_STREAK = 100_000
#: The `limit` of a request refused by the waiting-queue bound (Rule 4).
QUEUE_LIMIT = "max_waiting"
#: An open loop's arrivals are handed to the engine this many at a time (Rule 2).
FEED_CHUNK = 256


@attrs.frozen
class Refused:
    """A request the deployment can never run (`RequestRefused` from `Engine.submit`)."""

    arrival: Arrival
    limit: str
    reason: str


@attrs.frozen(kw_only=True)
class Progress:
    """A sample of the run for a progress display (taken every PROGRESS_EVERY events)."""

    time: float  # simulated seconds
    done: int  # completed requests
    refused: int
    total: int | None  # requests the workload will issue, when known
    running: int
    waiting: int
    kv_usage: float  # of the last step that started, in [0, 1]


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
        out["peak_waiting"] = self.peak_waiting
        out["capacity"] = None if self.capacity is None else self.capacity.to_dict()
        out["time"] = {
            "simulated_s": self.sim_time_s,
            "wall_s": self.wall_time_s,
            "speedup": self.sim_time_s / self.wall_time_s if self.wall_time_s > 0 else None,
        }
        return out


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
    reactive = generator.reactive
    closed = generator.closed_loop
    if isinstance(workload, Trace):
        total: int | None = len(workload.requests)
        seed_used = 0
    else:
        total = workload.num_requests if workload.sessions is None else None
        seed_used = workload.seed if seed is None else seed

    finished = FinishedTable()
    steps = StepTotals(speculative=deployment.speculative is not None)
    refused: list[Refused] = []
    held: dict[int, Arrival] = {}  # request id -> its arrival (but an open loop's)
    arrivals: dict[int, Arrival] | ArrivalTable = held
    first_arrival = math.inf
    streak = 0  # refusals since the last admitted request
    bound = deployment.scheduler.max_waiting  # Rule 4 (0: unbounded)
    ledger = Admission(engine, bound)  # seats and waiting places, as serve admits
    parked: list[Arrival] = []  # reactive: arrivals refused by the bound, until a completion
    rejected_at: list[float] = []  # arrival times refused by the bound

    def refuse(arrival: Arrival, limit: str, reason: str) -> None:
        nonlocal streak
        refused.append(Refused(arrival, limit, reason))
        streak += 1
        if streak >= MAX_REFUSAL_STREAK:
            raise SimError(
                f"{streak} requests in a row refused ({reason}); "
                "the workload cannot run on this deployment"
            )

    def submit(arrival: Arrival | None) -> None:
        nonlocal first_arrival, streak
        while arrival is not None:
            if arrival.time < first_arrival:
                first_arrival = arrival.time
            spec = RequestSpec(
                prompt_tokens=arrival.prompt_tokens,
                max_tokens=arrival.output_len,
                arrival_time=arrival.time,
                n=arrival.n,
                block_hashes=arrival.block_hashes,
            )
            try:
                request_id = engine.submit(spec)
            except RequestRefused as exc:
                refuse(arrival, exc.limit, exc.reason)
                arrival = generator.follow_up(arrival, arrival.time, True) if reactive else None
                continue
            streak = 0
            held[request_id] = arrival
            return

    # Rule 2: an open loop is fed from arrays, as the loop reaches it
    lazy = type(generator) is OpenLoopGenerator
    initial: list[Arrival] = []
    if isinstance(generator, OpenLoopGenerator) and lazy:
        feed_times, feed_prompts, feed_outputs = generator.arrays()
        table = ArrivalTable(feed_times, feed_prompts, feed_outputs)
        arrivals = table
        feed_count = len(feed_times)
        if feed_count:
            first_arrival = float(feed_times.min())
    else:
        initial = generator.initial()
        feed_times = np.array([a.time for a in initial], dtype=np.float64)
        feed_count = 0
    fed = 0  # arrivals of the open loop handed to the engine
    new_spec = frozen_builder(RequestSpec)  # (RequestSpec's __init__, at half the cost)
    next_feed = float(feed_times[0]) if feed_count else math.inf
    never_fit: list[int] = []  # positions of the fed arrivals that can never run

    def feed() -> None:
        """Hand the next FEED_CHUNK arrivals of the open loop to the engine (Rule 2)."""
        nonlocal fed, next_feed, streak
        end = min(fed + FEED_CHUNK, feed_count)
        for i, t, p, o in zip(
            range(fed, end),
            feed_times[fed:end].tolist(),
            feed_prompts[fed:end].tolist(),
            feed_outputs[fed:end].tolist(),
            strict=True,
        ):
            spec = new_spec(prompt_tokens=p, max_tokens=o, arrival_time=t)
            try:
                request_id = engine.submit(spec, preorder=i)
            except RequestRefused as exc:
                never_fit.append(i)
                refuse(table.arrival(i), exc.limit, exc.reason)
                continue
            streak = 0
            table.add(request_id, i)
        fed = end
        next_feed = float(feed_times[end]) if end < feed_count else math.inf

    # Open loop: the queue is recorded at the middle and the end of the arrival window
    # for the capacity verdict (`inference_lab.sim.capacity`, Rule 1).
    mid_arrival = (
        (float(feed_times.min()) + float(feed_times.max())) / 2
        if len(feed_times) and not closed
        else -math.inf
    )
    waiting_at_mid = waiting_at_end = 0
    for arrival in initial:
        submit(arrival)

    # The hot loop: locals for bound methods, constant work per event.
    next_event_time = engine.next_event_time
    step = engine.step
    num_waiting = engine.num_waiting
    add_step = steps.add
    add_finished = finished.extend
    peak_waiting = num_waiting()
    kv_usage = 0.0
    events = 0
    report_at = PROGRESS_EVERY
    recorder = SeriesRecorder(series_interval, engine) if series_interval is not None else None
    series_end = recorder.end if recorder is not None else math.inf

    def report() -> None:
        if progress is not None:
            progress(
                Progress(
                    time=engine.now,
                    done=len(finished),
                    refused=len(refused),
                    total=total,
                    running=engine.num_running(),
                    waiting=engine.num_waiting(),
                    kv_usage=kv_usage,
                )
            )

    # Rule 7: arrivals in a run, when nothing needs them one event at a time
    take_arrivals = (
        engine.take_arrivals if not bound and recorder is None and on_events is None else None
    )
    past_mid = math.nextafter(mid_arrival, math.inf)
    while True:
        t_next = next_event_time()
        if fed < feed_count and (t_next is None or next_feed <= t_next):
            feed()  # Rule 2: before the engine handles an event past the next arrival
            continue
        if t_next is None:
            break
        if take_arrivals is not None:
            arrived = take_arrivals(next_feed if t_next > mid_arrival else min(next_feed, past_mid))
            if arrived:
                waiting = num_waiting()
                if engine.now <= mid_arrival:
                    waiting_at_mid = waiting
                waiting_at_end = waiting
                if waiting > peak_waiting:
                    peak_waiting = waiting
                events += arrived
                if events >= report_at:
                    report_at += PROGRESS_EVERY
                    report()
                continue
        if t_next >= series_end and recorder is not None:
            series_end = recorder.close_until(t_next, engine)
        ev = step()
        if recorder is not None:
            recorder.observe(ev)
        if on_events is not None:
            on_events(ev)
        info = ev.step
        if info is not None:
            add_step(info)
            kv_usage = info.kv_usage
        if ev.arrived or (info is not None and info.preempted):
            waiting = num_waiting()
            if ev.arrived:
                if bound:
                    ledger.changed()
                    places = ledger.depth()
                    if places > bound:  # no seat, and it found `bound` places taken (Rule 4)
                        rid = ev.arrived[0]
                        engine.abort(rid)
                        waiting -= 1
                        arrival = arrivals.pop(rid)
                        rejected_at.append(arrival.time)
                        reason = f"{places - 1} waiting (max_waiting = {bound})"
                        refuse(arrival, QUEUE_LIMIT, reason)
                        if recorder is not None:
                            recorder.refused()
                        if reactive:
                            parked.append(arrival)
                if ev.time <= mid_arrival:
                    waiting_at_mid = waiting
                waiting_at_end = waiting
            if waiting > peak_waiting:
                peak_waiting = waiting
        if ev.finished:
            add_finished(ev.finished)
            if reactive:
                for f in ev.finished:
                    submit(generator.follow_up(arrivals[f.request_id], f.finish_time, False))
                if parked:  # Rule 4: the refused users try again now
                    again, parked[:] = parked[:], []
                    for refused_arrival in again:
                        submit(generator.follow_up(refused_arrival, ev.time, True))
        events += 1
        if events >= report_at:
            report_at += PROGRESS_EVERY
            report()
    report()

    summary = summarize(
        finished,
        steps,
        refused=len(refused),
        first_arrival=first_arrival if first_arrival != math.inf else None,
    )
    capacity = None
    if not closed:
        if lazy:
            offered = np.delete(feed_times, never_fit)
        else:
            unfit = {id(r.arrival) for r in refused if r.limit != QUEUE_LIMIT}
            offered = np.array([a.time for a in initial if id(a) not in unfit], np.float64)
        capacity = assess_capacity(
            offered,
            finished.column("finish_time"),
            rejected=rejected_at,
            waiting_at_mid=waiting_at_mid,
            waiting_at_end=waiting_at_end,
        )
    stats: EngineStatistics = engine.statistics()
    return SimResult(
        summary=summary,
        finished=finished,
        refused=tuple(refused),
        sim_time_s=engine.now,
        wall_time_s=time.perf_counter() - wall_start,
        peak_waiting=peak_waiting,
        seed=seed_used,
        arrivals=arrivals,
        prefix_cache=prefix_cache_summary(stats, finished),
        replicas=replica_summaries(stats, finished),
        sessions=(
            session_summary(finished, arrivals)
            if isinstance(workload, Workload) and workload.sessions is not None
            else None
        ),
        has_content=generator.has_content,
        capacity=capacity,
        series=recorder.finish(engine.now, engine) if recorder is not None else None,
        speculative=(speculative_summary(steps) if deployment.speculative is not None else None),
    )


# ---------------------------------------------------------------------------------------
# describing the run


def _describe_dist(dist: Any) -> str:
    fields = {a.name: getattr(dist, a.name) for a in attrs.fields(type(dist)) if a.name != "type"}
    args = ", ".join(
        f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()
    )
    return f"{dist.type}({args})"


def _describe_schedule(workload: Workload) -> str:
    sch = workload.rate_schedule
    return f"{workload.arrival_rate:g} req/s" if sch is None else sch.describe()


def _describe_arrivals(workload: Workload) -> str:
    pattern = workload.arrival_pattern
    unit = "req/s"
    if workload.sessions is not None:
        unit = "sessions/s"
    if pattern in ("poisson", "uniform"):
        what = f"{pattern}, {_describe_schedule(workload).replace('req/s', unit)}"
    elif pattern == "closed_loop":
        what = f"closed loop, {workload.num_concurrent_users} users"
        if workload.closed_loop_jitter_secs > 0:
            what += f", start jitter {workload.closed_loop_jitter_secs:g} s"
    else:
        what = pattern
    limits = []
    sessions = workload.sessions
    if sessions is not None and sessions.num_sessions is not None:
        limits.append(f"{sessions.num_sessions:,} sessions")
    if workload.num_requests is not None:
        limits.append(f"{workload.num_requests:,} requests")
    if workload.duration_secs is not None:
        starts = "session starts" if sessions is not None else "arrivals"
        limits.append(f"{starts} for {workload.duration_secs:g} s")
    return f"{what}; {' / '.join(limits)}"


def _describe_sessions(workload: Workload) -> str:
    s = workload.sessions
    assert s is not None
    system = (
        f"system prompt {s.system_prompt_tokens:,} tokens"
        + (" (shared)" if s.shared_system_prompt else " (per session)")
        if s.system_prompt_tokens
        else "no system prompt"
    )
    return (
        f"           sessions: turns {_describe_dist(s.turns)}, think time "
        f"{_describe_dist(s.think_time)} s, {system}"
    )


def describe_trace(trace: Trace) -> str:
    """One line naming a trace, its format, what was kept and how it was scaled."""
    window = ""
    if trace.start or trace.end is not None:
        end = "end" if trace.end is None else f"{trace.end:g} s"
        window = f", window {trace.start:g} s to {end}"
    speed = f", speedup {trace.speedup:g}" if trace.speedup != 1 else ""
    dropped = []
    if trace.skipped_failed:
        dropped.append(f"{trace.skipped_failed:,} failed rows skipped")
    if trace.outside_window:
        dropped.append(f"{trace.outside_window:,} outside the window")
    rest = f" ({'; '.join(dropped)})" if dropped else ""
    span = trace.requests[-1].time if trace.requests else 0.0
    return (
        f"{trace.path}: {trace.format} trace, {len(trace.requests):,} requests over "
        f"{span:,.3f} s{window}{speed}{rest}"
    )


def config_dict(
    deployment: Deployment, workload: Workload | Trace, workload_path: str, seed: int
) -> dict[str, Any]:
    """The run's configuration as plain JSON values: the `config` section of `sim -o`'s
    file (called by `sim_cli.run`)."""
    hw = deployment.hardware
    sched = deployment.scheduler
    if isinstance(workload, Trace):
        workload_doc: dict[str, Any] = {
            "trace": str(workload.path),
            "format": workload.format,
            "speedup": workload.speedup,
            "window_start_s": workload.start,
            "window_end_s": workload.end,
            "rows": workload.rows,
            "requests": len(workload.requests),
            "skipped_failed": workload.skipped_failed,
            "outside_window": workload.outside_window,
        }
    else:
        workload_doc = {
            "path": workload_path,
            "arrival_pattern": workload.arrival_pattern,
            "arrival_rate": workload.arrival_rate,
            "num_concurrent_users": workload.num_concurrent_users,
            "closed_loop_jitter_secs": workload.closed_loop_jitter_secs,
            "input_len_dist": attrs.asdict(workload.input_len_dist),
            "output_len_dist": attrs.asdict(workload.output_len_dist),
            "num_requests": workload.num_requests,
            "duration_secs": workload.duration_secs,
            "seed": seed,
        }
        if workload.sessions is not None:
            workload_doc["sessions"] = attrs.asdict(workload.sessions)
        if workload.rate_schedule is not None:
            workload_doc["rate_schedule"] = attrs.asdict(workload.rate_schedule)
    return {
        "model": deployment.model.name,
        "config": str(deployment.config_path),
        "hardware": deployment.hardware_name,
        "gpu": deployment.profile.name,
        "tp": hw.tp,
        "ep": hw.ep,
        "dp_attention": hw.dp_attention,
        "replicas": hw.replicas,
        "router": hw.router,
        "affinity_load_ratio": hw.affinity_load_ratio,
        "kv_aware_queue_weight": hw.kv_aware_queue_weight,
        "time_correction": {"alpha": hw.time_correction.alpha, "beta": hw.time_correction.beta},
        "efficiency": attrs.asdict(deployment.efficiency),
        "step_table": hw.step_table,
        "scheduler": attrs.asdict(sched),
        "kv_blocks_per_replica": deployment.total_blocks,
        "speculative": (
            None
            if deployment.speculative is None
            else {
                **attrs.asdict(deployment.speculative),
                "rates": list(deployment.acceptance_rates),
            }
        ),
        "workload": workload_doc,
    }


def format_config(
    deployment: Deployment, workload: Workload | Trace, workload_path: str, seed: int
) -> str:
    """The configuration block `inference-lab sim` prints before the run: model, hardware,
    KV cache, scheduler, timing correction (when not the identity) and workload."""
    hw = deployment.hardware
    sched = deployment.scheduler
    kv_gib = deployment.kv_bytes / 2**30
    replicas = f"{hw.replicas} replica" + ("s" if hw.replicas != 1 else "")
    if hw.replicas > 1:
        replicas += f" ({hw.router})"
    chunk = "on" if sched.enable_chunked_prefill else "off"
    if sched.enable_chunked_prefill and sched.long_prefill_token_threshold > 0:
        chunk += f", chunk cap {sched.long_prefill_token_threshold}"
    tc = hw.time_correction
    lines = [
        f"model      {deployment.model.name}  ({deployment.config_path})",
        f"hardware   {deployment.hardware_name}: {deployment.profile.name} x tp {hw.tp}"
        + (f", ep {hw.ep}" if hw.ep > 1 else "")
        + (f", dp attention {hw.dp_attention}" if hw.dp_attention > 1 else "")
        + f", {replicas}",
        f"KV cache   {deployment.total_blocks:,} blocks of {sched.block_size} tokens per "
        + ("replica" if hw.dp_attention == 1 else "attention rank")
        + f" ({kv_gib:,.1f} GiB)",
        f"scheduler  max_num_batched_tokens {sched.max_num_batched_tokens}, max_num_seqs "
        f"{sched.max_num_seqs}, max_waiting {sched.max_waiting}, policy {sched.policy}, "
        f"chunked prefill {chunk}"
        + (
            f", frontend latency {sched.frontend_latency * 1e3:g} ms"
            if sched.frontend_latency
            else ""
        ),
    ]
    eff = deployment.efficiency
    if not eff.is_identity:
        lines.append(
            f"efficiency HBM bandwidth {eff.memory_bandwidth:g}, FLOP/s {eff.flops:g} of the "
            f"datasheet; {eff.step_overhead * 1e3:g} ms per step"
        )
    if hw.step_table is not None:
        lines.append(f"steps      measured step table {hw.step_table} (roofline-scaled outside it)")
    spec = deployment.speculative
    if spec is not None:
        rates = ", ".join(f"{r:.3g}" for r in deployment.acceptance_rates)
        policy = (
            "; gamma by batch " + ", ".join(f"{g} from {at}" for at, g in spec.gamma_by_batch)
            if spec.gamma_by_batch
            else ""
        )
        lines.append(
            f"speculative {spec.method}: {spec.num_speculative_tokens} draft token(s) per step "
            f"({spec.drafter.kind} drafter), acceptance by position {rates}, seed "
            f"{spec.seed}{policy}"
        )
    if tc.alpha != 1.0 or tc.beta != 0.0:
        lines.append(f"timing     step = {tc.alpha:g} x roofline + {tc.beta:g} s")
    if isinstance(workload, Trace):
        lines.append(f"workload   {describe_trace(workload)}")
        return "\n".join(lines)
    inputs = "input" if workload.sessions is None else "user tokens per turn"
    outputs = "output" if workload.sessions is None else "answer"
    lines += [
        f"workload   {workload_path}: {_describe_arrivals(workload)}",
        f"           {inputs} {_describe_dist(workload.input_len_dist)}, {outputs} "
        f"{_describe_dist(workload.output_len_dist)}, seed {seed}",
    ]
    if workload.sessions is not None:
        lines.append(_describe_sessions(workload))
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.3f}"


def format_summary(result: SimResult) -> str:
    """The summary `inference-lab sim` prints after the run: the latency table (ms) and one
    line each for requests, throughput, utilisation, preemptions and time."""
    s = result.summary
    rows = [("TTFT", s.ttft), ("TPOT", s.tpot), ("E2E", s.e2e), ("queue", s.queue)]
    table = [["latency (ms)", *LATENCY_COLUMNS, "n"]]
    for name, stats in rows:
        table.append([name, *(_ms(getattr(stats, c)) for c in LATENCY_COLUMNS), f"{stats.count:,}"])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = [
        "  ".join(
            cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row)
        )
        for row in table
    ]
    over = result.capacity.message() if result.capacity is not None else None
    if over is not None:
        lines.append(over)
    speedup = (
        f" ({result.sim_time_s / result.wall_time_s:,.1f}x real time)"
        if result.wall_time_s > 0
        else ""
    )
    refused_note = ""
    if result.refused:
        by_limit: dict[str, int] = {}
        for r in result.refused:
            by_limit[r.limit] = by_limit.get(r.limit, 0) + 1
        never = sorted(limit for limit in by_limit if limit != QUEUE_LIMIT)
        parts = []
        if QUEUE_LIMIT in by_limit:
            parts.append(f"{by_limit[QUEUE_LIMIT]:,} by max_waiting")
        if never:
            first = next(r for r in result.refused if r.limit != QUEUE_LIMIT)
            parts.append(f"never fit: {', '.join(never)}; e.g. {first.reason}")
        refused_note = f" ({'; '.join(parts)})"
    lines += [
        "",
        f"requests     {s.requests_completed:,} completed, {s.requests_refused:,} refused"
        f"{refused_note}",
        f"throughput   {s.input_tokens_per_s:,.1f} input tok/s, {s.output_tokens_per_s:,.1f} "
        f"output tok/s, {s.requests_per_s:,.3f} req/s over {s.span_s:,.3f} s",
        f"utilisation  KV cache {s.kv_usage_mean:.1%} mean ({s.kv_usage_max:.1%} peak), "
        f"FLOP {s.flop_util_mean:.1%}, HBM bandwidth {s.bw_util_mean:.1%} "
        f"(means over {s.steps:,} steps)",
        f"preemptions  {s.preemptions:,}; peak waiting queue {result.peak_waiting:,}",
    ]
    lines += _cache_lines(result)
    sp = result.speculative
    if sp is not None:
        lines.append(
            f"speculative  {sp.drafts:,} drafts, mean acceptance length "
            f"{sp.mean_acceptance_length:.2f} ({sp.acceptance_rate:.1%} of "
            f"{sp.draft_tokens:,} draft tokens accepted); speed-up {sp.speedup:.2f}x "
            "(estimated: the same batches without speculation)"
        )
    lines.append(
        f"time         {result.sim_time_s:,.3f} s simulated in {result.wall_time_s:,.3f} s real"
        f"{speedup}"
    )
    return "\n".join(lines)


def _cache_lines(result: SimResult) -> list[str]:
    """The prefix-cache, session and replica lines: only for a workload whose requests
    carry content (the cache can hit) and for several replicas, so a run of a workload
    without either prints what it always printed."""
    lines = []
    pc = result.prefix_cache
    if pc is not None and (result.has_content or pc.hit_tokens):
        if pc.enabled:
            lines.append(
                f"prefix cache on: {pc.hit_rate:.1%} of {pc.query_tokens:,} prompt tokens "
                f"cached ({pc.hit_tokens:,} prefill tokens saved); {pc.requests_hit:,} of "
                f"{pc.requests:,} requests hit"
            )
        else:
            lines.append("prefix cache off (enable_prefix_caching = false)")
    ss = result.sessions
    if ss is not None:
        ttfts = " ".join(
            "-" if t.ttft.p50 is None else f"{t.ttft.p50:,.1f}" for t in ss.by_turn[:12]
        )
        more = " ..." if len(ss.by_turn) > 12 else ""
        lines.append(
            f"sessions     {ss.sessions:,} sessions, {ss.turns:,} turns; TTFT p50 by turn (ms) "
            f"{ttfts}{more}"
        )
    if len(result.replicas) > 1:
        requests = " / ".join(f"{r.requests:,}" for r in result.replicas)
        line = f"replicas     {len(result.replicas)}: requests {requests}"
        if pc is not None and pc.enabled and (result.has_content or pc.hit_tokens):
            line += "; hit rate " + " / ".join(f"{r.hit_rate:.1%}" for r in result.replicas)
        lines.append(line)
    return lines


CSV_COLUMNS = (
    "request_id",
    "status",
    "arrival_time_s",
    "prompt_tokens",
    "max_tokens",
    "output_tokens",
    "finish_reason",
    "first_scheduled_time_s",
    "first_token_time_s",
    "finish_time_s",
    "queue_ms",
    "ttft_ms",
    "tpot_ms",
    "e2e_ms",
    "preemptions",
    "refusal",
    "cached_tokens",
    "session",
    "turn",
    "replica",
)


def _finished_row(f: Finished, arrivals: Mapping[int, Arrival]) -> dict[str, Any]:
    tpot: float | str = ""  # undefined for a single-token request
    if f.output_tokens > 1:
        tpot = (f.finish_time - f.first_token_time) / (f.output_tokens - 1) * 1e3
    row = {
        "request_id": f.request_id,
        "status": "completed",
        "arrival_time_s": f.arrival_time,
        "prompt_tokens": f.prompt_tokens,
        "max_tokens": f.output_tokens,  # sim submits max_tokens = target (Rule 3)
        "output_tokens": f.output_tokens,
        "finish_reason": f.finish_reason,
        "first_scheduled_time_s": f.first_scheduled_time,
        "first_token_time_s": f.first_token_time,
        "finish_time_s": f.finish_time,
        "queue_ms": (f.first_scheduled_time - f.arrival_time) * 1e3,
        "ttft_ms": (f.first_token_time - f.arrival_time) * 1e3,
        "tpot_ms": tpot,
        "e2e_ms": (f.finish_time - f.arrival_time) * 1e3,
        "preemptions": f.preemptions,
        "cached_tokens": f.cached_tokens,
        "replica": f.worker,
    }
    arrival = arrivals.get(f.request_id)
    if arrival is not None and arrival.session >= 0:
        row["session"] = arrival.session
        row["turn"] = arrival.turn
    return row


def _refused_row(r: Refused) -> dict[str, Any]:
    a = r.arrival
    row: dict[str, Any] = {
        "status": "refused",
        "arrival_time_s": a.time,
        "prompt_tokens": a.prompt_tokens,
        "max_tokens": a.output_len,
        "output_tokens": 0,
        "preemptions": 0,
        "refusal": r.reason,
    }
    if a.session >= 0:
        row["session"] = a.session
        row["turn"] = a.turn
    return row


def write_request_csv(result: SimResult, out: IO[str]) -> int:
    """One row per request (completed and refused), in arrival order (then request id, a
    refused request's being -1); returns the row count.

    Times are simulated seconds, latencies ms; a refused request has no id and no timings.
    Rows are made one at a time from the run's compact records and written as they are
    made (Rule 7): only the order (8 bytes per request) is held.
    """
    fin = result.finished
    if isinstance(fin, FinishedTable):
        times = fin.column("arrival_time")
        ids = fin.column("request_id")
    else:
        times = np.array([f.arrival_time for f in fin], dtype=np.float64)
        ids = np.array([f.request_id for f in fin], dtype=np.int64)
    refused = result.refused
    times = np.concatenate((times, np.array([r.arrival.time for r in refused], np.float64)))
    ids = np.concatenate((ids, np.full(len(refused), -1, dtype=np.int64)))
    order = np.lexsort((ids, times))  # stable: ties keep completions before refusals
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, restval="")
    writer.writeheader()
    completed = len(fin)
    arrivals = result.arrivals
    for k in order.tolist():
        if k < completed:
            writer.writerow(_finished_row(fin[k], arrivals))
        else:
            writer.writerow(_refused_row(refused[k - completed]))
    return len(order)
