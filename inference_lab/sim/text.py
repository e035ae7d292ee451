"""Describing a simulation: the configuration block and the summary ``inference-lab sim``
prints, the ``config`` section of its JSON file, and the request CSV.

Rule 1: every function here reads a finished run (or the configuration), never the
        engine: the text, JSON and CSV are pure functions of their arguments.
Rule 2: the request CSV is made one row at a time from the run's compact records and
        written as it is made: only the order (8 bytes per request) is held.

Who calls it: ``sim/cli.py`` (the ``sim`` command) and the report (``sim/report.py``).
"""

from __future__ import annotations

import csv
from collections.abc import Mapping
from typing import IO, Any

import attrs
import numpy as np

from inference_lab.core.config import Deployment, Workload
from inference_lab.core.engine import Finished
from inference_lab.sim.records import QUEUE_LIMIT, FinishedTable, Refused
from inference_lab.sim.run import SimResult
from inference_lab.sim.summary import LATENCY_COLUMNS
from inference_lab.traffic.traces import Trace
from inference_lab.workload.arrivals import Arrival

__all__ = [
    "CSV_COLUMNS",
    "config_dict",
    "describe_trace",
    "format_config",
    "format_summary",
    "write_request_csv",
]


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
        "efficiency": _efficiency_dict(deployment),
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
            + (f"; MoE routing skew {eff.expert_skew:g}" if eff.expert_skew else "")
            + (
                f"; {eff.layer_overhead * 1e6:g} µs per layer per step"
                if eff.layer_overhead
                else ""
            )
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
    peak = f"{result.peak_waiting:,}"
    if result.fleet is not None:  # (the shards' peaks summed)
        peak = f"<= {peak} (the shards' peaks summed)"
    over = result.capacity.message() if result.capacity is not None else None
    if over is not None:
        lines.append(over)
    speedup = (
        f" ({result.sim_time_s / result.wall_time_s:,.1f}x real time)"
        if result.wall_time_s > 0
        else ""
    )
    lines += [
        "",
        f"requests     {s.requests_completed:,} completed, {s.requests_refused:,} refused"
        f"{_refused_note(result)}",
        f"throughput   {s.input_tokens_per_s:,.1f} input tok/s, {s.output_tokens_per_s:,.1f} "
        f"output tok/s, {s.requests_per_s:,.3f} req/s over {s.span_s:,.3f} s",
        f"utilisation  KV cache {s.kv_usage_mean:.1%} mean ({s.kv_usage_max:.1%} peak), "
        f"FLOP {s.flop_util_mean:.1%}, HBM bandwidth {s.bw_util_mean:.1%} "
        f"(means over {s.steps:,} steps)",
        f"preemptions  {s.preemptions:,}; peak waiting queue {peak}",
    ]
    lines += _cache_lines(result)
    if result.fleet is not None:
        fl = result.fleet
        lines.append(
            f"sharded      {fl.replicas:,} replicas in {fl.shards:,} shards, "
            f"{fl.parallelism:,} at a time; percentiles from merged sketches (within "
            f"{fl.relative_accuracy:.2%})"
        )
    sp = result.speculative
    if sp is not None:
        lines.append(
            f"speculative  {sp.drafts:,} drafts, mean acceptance length "
            f"{sp.mean_acceptance_length:.2f} ({sp.acceptance_rate:.1%} of "
            f"{sp.draft_tokens:,} draft tokens accepted); speed-up {sp.speedup:.2f}x "
            "(estimated: the same batches without speculation)"
        )
    lines += _disaggregation_lines(result)
    tiers = result.tiers
    if tiers is not None:
        lines.append(
            f"KV tiers     prompt tokens found in HBM {tiers.hbm_hit_rate:.1%}, host "
            f"{tiers.host_hit_rate:.1%}, disk {tiers.disk_hit_rate:.1%}; {tiers.fetches:,} "
            f"fetches of {tiers.fetch_bytes / 1e9:,.2f} GB ({tiers.fetch_seconds_mean * 1e3:,.3f} "
            f"ms each on average); {tiers.recomputed_tokens:,} tokens recomputed where "
            "fetching cost more"
        )
    lora = result.lora
    if lora is not None:
        spread = ", ".join(f"{name} {n:,}" for name, n in lora.requests.items())
        lines.append(
            f"LoRA         {lora.loads:,} adapter loads ({lora.cold_loads:,} cold), "
            f"{lora.load_seconds * 1e3:,.3f} ms loading; {lora.skips:,} skips for a slot "
            f"(max_loras); requests: {spread or 'none named an adapter'}"
        )
    lines.append(
        f"time         {result.sim_time_s:,.3f} s simulated in {result.wall_time_s:,.3f} s real"
        f"{speedup}"
    )
    return "\n".join(lines)


def _disaggregation_lines(result: SimResult) -> list[str]:
    """A disaggregated run's lines: the pools, the transfers, TTFT's four stages (ms)."""
    pd = result.disaggregation
    if pd is None:
        return []
    pools = ", ".join(
        f"{p.role} {p.replicas} x {p.hardware} (tp {p.tp}) busy {p.busy_share:.1%}"
        for p in (pd.prefill, pd.decode)
    )
    stages = "; ".join(
        f"{name} {_ms(stats.mean)} / {_ms(stats.p99)}"
        for name, stats in (
            ("queue", pd.ttft_queue),
            ("prefill", pd.ttft_prefill),
            ("hand-off", pd.ttft_handoff),
            ("first decode step", pd.ttft_first_decode),
        )
    )
    return [
        f"pools        {pools}",
        f"transfers    {pd.transfers:,} over {pd.link} ({pd.streams} links at once), "
        f"{pd.transfer_bytes_mean / 1e6:,.1f} MB and {pd.transfer_seconds_mean * 1e3:,.3f} ms "
        "each on average",
        f"TTFT stages  (mean / p99 ms) {stages}",
    ]


def _refused_note(result: SimResult) -> str:
    """The requests line's note on the refusals: how many ``max_waiting`` refused, and the
    limits of those that never fit with the first one's reason."""
    by_limit: dict[str, int] = {}
    for r in result.refused:
        by_limit[r.limit] = by_limit.get(r.limit, 0) + 1
    first = next((r.reason for r in result.refused if r.limit != QUEUE_LIMIT), "")
    if result.fleet is not None:  # (a sharded run keeps no request)
        by_limit = dict(result.fleet.refusals)
        first = result.fleet.first_refusal
    never = sorted(limit for limit in by_limit if limit != QUEUE_LIMIT)
    parts = []
    if QUEUE_LIMIT in by_limit:
        parts.append(f"{by_limit[QUEUE_LIMIT]:,} by max_waiting")
    if never:
        parts.append(f"never fit: {', '.join(never)}; e.g. {first}")
    return f" ({'; '.join(parts)})" if parts else ""


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
        "max_tokens": f.output_tokens,  # sim submits max_tokens = target (`sim.intake`)
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
    made (Rule 2): only the order (8 bytes per request) is held.
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


def _efficiency_dict(deployment: Deployment) -> dict[str, float]:
    """The efficiency terms a run's JSON records: ``expert_skew`` and ``layer_overhead``
    only where they are set (a run without them records what it recorded before the terms
    existed)."""
    out = attrs.asdict(deployment.efficiency)
    for name in ("expert_skew", "layer_overhead"):
        if not out[name]:
            del out[name]
    return out
