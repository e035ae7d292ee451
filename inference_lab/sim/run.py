"""The offline simulation behind `inference-lab sim`: a workload through the engine, as fast
as the CPU allows, and the text, JSON and CSV that describe the run.

Rule 1: the simulation is `run_simulation`, a plain loop over `Engine.step()`; it is the only
        place that reads the wall clock (to report real time) and it does constant work per
        engine event (appending the step / completions, a counter for progress), so the
        engine's own cost dominates.
Rule 2: open-loop arrivals are all submitted before the first step (the engine's event heap
        orders them); a closed-loop user's next request is submitted at its previous
        request's finish time, from the `step()` that reported the completion.
Rule 3: every request is submitted with `max_tokens = target = ` the sampled output length, so
        it runs to its sampled length and finishes with reason `length`; a request the
        deployment can never run (`RequestRefused`) is counted apart and, in a closed loop,
        its user moves straight on to its next request.

Dependencies: config -> engine -> this module -> `sim_cli` (the `inference-lab sim` command,
which prints and writes what the functions of this module's second half format).
"""

from __future__ import annotations

import csv
import math
import time
from collections.abc import Callable
from typing import IO, Any

import attrs

from inference_lab.core.config import Deployment, Workload
from inference_lab.core.engine import Engine, Finished, RequestSpec, StepEvents, StepInfo
from inference_lab.errors import RequestRefused, SimError
from inference_lab.sim.summary import LATENCY_COLUMNS, SimSummary, summarize
from inference_lab.sim.workload import Arrival, make_generator

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
    finished: tuple[Finished, ...]  # in completion order
    refused: tuple[Refused, ...]
    sim_time_s: float  # engine clock at the end (the last event)
    wall_time_s: float  # real seconds spent in the loop (submits included)
    peak_waiting: int  # largest waiting queue seen after an arrival or a preemption
    seed: int  # the seed the arrivals were drawn with

    def to_dict(self) -> dict[str, Any]:
        """The summary sections of `sim -o`'s JSON, plus the peak queue and the times."""
        out = self.summary.to_dict()
        out["peak_waiting"] = self.peak_waiting
        out["time"] = {
            "simulated_s": self.sim_time_s,
            "wall_s": self.wall_time_s,
            "speedup": self.sim_time_s / self.wall_time_s if self.wall_time_s > 0 else None,
        }
        return out


def run_simulation(
    deployment: Deployment,
    workload: Workload,
    seed: int | None = None,
    progress: Callable[[Progress], None] | None = None,
    on_events: Callable[[StepEvents], None] | None = None,
) -> SimResult:
    """Run `workload` (seeded with `seed` if given, else its own seed) on a fresh engine for
    `deployment` until every request has finished or been refused.

    `on_events`, when given, sees every `StepEvents` the engine returns, in order (the
    planner's inter-token latencies are measured from them).

    Raises ConfigError for an unusable workload and SimError for one that cannot progress.
    """
    wall_start = time.perf_counter()
    engine = Engine(deployment)
    generator = make_generator(workload, seed)
    closed = generator.closed_loop
    total = workload.num_requests

    finished: list[Finished] = []
    steps: list[StepInfo] = []
    refused: list[Refused] = []
    user_of: dict[int, int] = {}  # closed loop: request id -> user
    first_arrival = math.inf
    streak = 0  # refusals since the last admitted request

    def submit(arrival: Arrival | None) -> None:
        nonlocal first_arrival, streak
        while arrival is not None:
            if arrival.time < first_arrival:
                first_arrival = arrival.time
            spec = RequestSpec(
                prompt_tokens=arrival.prompt_tokens,
                max_tokens=arrival.output_len,
                arrival_time=arrival.time,
            )
            try:
                request_id = engine.submit(spec)
            except RequestRefused as exc:
                refused.append(Refused(arrival, exc.limit, exc.reason))
                streak += 1
                if streak >= MAX_REFUSAL_STREAK:
                    raise SimError(
                        f"{streak} requests in a row refused ({exc.reason}); "
                        "the workload cannot run on this deployment"
                    ) from None
                arrival = generator.on_complete(arrival.user, arrival.time) if closed else None
                continue
            streak = 0
            if closed:
                user_of[request_id] = arrival.user
            return

    for arrival in generator.initial():
        submit(arrival)

    # The hot loop: locals for bound methods, constant work per event.
    next_event_time = engine.next_event_time
    step = engine.step
    num_waiting = engine.num_waiting
    add_step = steps.append
    add_finished = finished.extend
    peak_waiting = num_waiting()
    kv_usage = 0.0
    events = 0
    report_at = PROGRESS_EVERY

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

    while next_event_time() is not None:
        ev = step()
        if on_events is not None:
            on_events(ev)
        info = ev.step
        if info is not None:
            add_step(info)
            kv_usage = info.kv_usage
        if ev.arrived or (info is not None and info.preempted):
            waiting = num_waiting()
            if waiting > peak_waiting:
                peak_waiting = waiting
        if ev.finished:
            add_finished(ev.finished)
            if closed:
                for f in ev.finished:
                    submit(generator.on_complete(user_of.pop(f.request_id), f.finish_time))
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
    return SimResult(
        summary=summary,
        finished=tuple(finished),
        refused=tuple(refused),
        sim_time_s=engine.now,
        wall_time_s=time.perf_counter() - wall_start,
        peak_waiting=peak_waiting,
        seed=workload.seed if seed is None else seed,
    )


# ---------------------------------------------------------------------------------------
# describing the run


def _describe_dist(dist: Any) -> str:
    fields = {a.name: getattr(dist, a.name) for a in attrs.fields(type(dist)) if a.name != "type"}
    args = ", ".join(
        f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()
    )
    return f"{dist.type}({args})"


def _describe_arrivals(workload: Workload) -> str:
    pattern = workload.arrival_pattern
    if pattern in ("poisson", "uniform"):
        what = f"{pattern}, {workload.arrival_rate:g} req/s"
    elif pattern == "closed_loop":
        what = f"closed loop, {workload.num_concurrent_users} users"
        if workload.closed_loop_jitter_secs > 0:
            what += f", start jitter {workload.closed_loop_jitter_secs:g} s"
    else:
        what = pattern
    limits = []
    if workload.num_requests is not None:
        limits.append(f"{workload.num_requests:,} requests")
    if workload.duration_secs is not None:
        limits.append(f"arrivals for {workload.duration_secs:g} s")
    return f"{what}; {' / '.join(limits)}"


def config_dict(
    deployment: Deployment, workload: Workload, workload_path: str, seed: int
) -> dict[str, Any]:
    """The run's configuration as plain JSON values: the `config` section of `sim -o`'s
    file (called by `sim_cli.run`)."""
    hw = deployment.hardware
    sched = deployment.scheduler
    return {
        "model": deployment.model.name,
        "config": str(deployment.config_path),
        "hardware": deployment.hardware_name,
        "gpu": deployment.profile.name,
        "tp": hw.tp,
        "ep": hw.ep,
        "replicas": hw.replicas,
        "router": hw.router,
        "time_correction": {"alpha": hw.time_correction.alpha, "beta": hw.time_correction.beta},
        "scheduler": attrs.asdict(sched),
        "kv_blocks_per_replica": deployment.total_blocks,
        "workload": {
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
        },
    }


def format_config(deployment: Deployment, workload: Workload, workload_path: str, seed: int) -> str:
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
        + f", {replicas}",
        f"KV cache   {deployment.total_blocks:,} blocks of {sched.block_size} tokens per replica "
        f"({kv_gib:,.1f} GiB)",
        f"scheduler  max_num_batched_tokens {sched.max_num_batched_tokens}, max_num_seqs "
        f"{sched.max_num_seqs}, max_waiting {sched.max_waiting}, policy {sched.policy}, "
        f"chunked prefill {chunk}",
    ]
    if tc.alpha != 1.0 or tc.beta != 0.0:
        lines.append(f"timing     step = {tc.alpha:g} x roofline + {tc.beta:g} s")
    lines += [
        f"workload   {workload_path}: {_describe_arrivals(workload)}",
        f"           input {_describe_dist(workload.input_len_dist)}, output "
        f"{_describe_dist(workload.output_len_dist)}, seed {seed}",
    ]
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
    speedup = (
        f" ({result.sim_time_s / result.wall_time_s:,.1f}x real time)"
        if result.wall_time_s > 0
        else ""
    )
    refused_note = ""
    if result.refused:
        limits = sorted({r.limit for r in result.refused})
        refused_note = f" (never fit: {', '.join(limits)}; e.g. {result.refused[0].reason})"
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
        f"time         {result.sim_time_s:,.3f} s simulated in {result.wall_time_s:,.3f} s real"
        f"{speedup}",
    ]
    return "\n".join(lines)


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
)


def write_request_csv(result: SimResult, out: IO[str]) -> int:
    """One row per request (completed and refused), in arrival order; returns the row count.

    Times are simulated seconds, latencies ms; a refused request has no id and no timings.
    """
    rows: list[tuple[float, int, dict[str, Any]]] = []
    for f in result.finished:
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
        }
        rows.append((f.arrival_time, f.request_id, row))
    for r in result.refused:
        a = r.arrival
        row = {
            "status": "refused",
            "arrival_time_s": a.time,
            "prompt_tokens": a.prompt_tokens,
            "max_tokens": a.output_len,
            "output_tokens": 0,
            "preemptions": 0,
            "refusal": r.reason,
        }
        rows.append((a.time, -1, row))
    rows.sort(key=lambda item: (item[0], item[1]))
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, restval="")
    writer.writeheader()
    writer.writerows(row for _, _, row in rows)
    return len(rows)
