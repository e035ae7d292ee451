"""Benchmark the sharded simulator (``inference-lab sim --ray``) on a two-node local Ray
cluster, and project a fleet-day from what one worker does.

The fleet: gpt-oss-20b / b200 replicas behind round robin, each offered 60 requests/s of
``poisson-50rps-4000``'s request mix (lognormal prompts (6.9, 0.7) and outputs (5.3, 0.8),
seed 42): the moderately loaded deployment of the simulator's scale benchmark (one
replica completes about 240/s of this mix). The full day is 64 such replicas for 86,400
simulated seconds: 64 x 60 x 86,400 = 331,776,000 requests.

1. Scaling: ``--replicas`` (8) replicas for ``--window`` (600) simulated seconds, in 1, 2
   and 4 shards on a cluster of two raylets with two CPUs each (127.0.0.1 only), one
   shard per worker: the run's wall time, the speed-up over one worker, the shards' CPU
   seconds, and simulated requests per wall second. Every run must give the same answer
   (the same completions, steps and latency figures).
2. The per-worker cost: ``c_sim``, CPU seconds per simulated request (the shards' CPU
   without their first pass), and ``c_draw``, CPU seconds per arrival drawn by a shard's
   first pass over the whole stream (every shard draws every arrival: shard Rule 2).
3. The projection of the full day on W workers with a core each (W = 16, 32, 64): each
   shard simulates 64 / W replica-days and draws the day's whole stream once, so it
   takes ``64 / W x 5,184,000 x c_sim + 331,776,000 x c_draw``; the day takes as long as
   one shard (they run at once).
4. ``--day-shard``: one shard of the full day itself, run here in a fresh interpreter
   (the W = 64 case: one replica's 5,184,000 requests, its first pass over all
   331,776,000 arrivals): its wall and CPU seconds and peak RSS.

5. ``--sessions``: instead, sessions under ``session_affinity`` (``chat-sessions-200``'s
   8-turn sessions, starting at ``--session-rate`` (1) a second per replica for
   ``--window`` seconds) on ``--replicas`` replicas, unsharded in this process, then in
   2 and 4 shards on the cluster: wall and CPU seconds; every figure but the capacity
   verdict must agree (the percentiles within the sketches' bound).

On a machine shared with other work the wall times move with its load; it prints how
many cores two busy processes get, before and after (2.00 on an idle 2-core machine).

    python scripts/bench_fleet.py [--replicas N] [--window S] [--workers 1,2,4] [--day-shard]
    python scripts/bench_fleet.py --sessions [--replicas N] [--window S] [--session-rate R]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import time
from typing import Any

import attrs

from inference_lab.cli_args import CliParser, integer, number
from inference_lab.core.config import Deployment, Workload, load_deployment, load_workload
from inference_lab.resources import shipped_dir
from inference_lab.sim.fleet import run_fleet
from inference_lab.sim.run import SimResult, run_simulation
from inference_lab.sim.shard import run_shard, shard_deployment
from inference_lab.sim.sketch import RELATIVE_ACCURACY

RATE = 60.0  # requests/s offered to each replica
DAY_S = 86_400.0
DAY_REPLICAS = 64
DAY_REQUESTS = int(DAY_REPLICAS * RATE * DAY_S)


def fleet(replicas: int, window: float) -> tuple[Deployment, Workload]:
    """``replicas`` gpt-oss-20b / b200 replicas and the mix at RATE each for ``window``
    simulated seconds."""
    deployment = shard_deployment(
        load_deployment(shipped_dir("configs") / "gpt-oss-20b.toml", "b200"), replicas
    )
    mix = load_workload(shipped_dir("configs") / "workloads" / "poisson-50rps-4000.toml")
    workload = attrs.evolve(
        mix, arrival_rate=RATE * replicas, num_requests=None, duration_secs=window
    )
    return deployment, workload


def _spin(n: int) -> float:
    start = time.perf_counter()
    x = 0
    for i in range(n):
        x += i
    return time.perf_counter() - start


def machine_parallelism(n: int = 20_000_000) -> float:
    """How many cores two busy processes get now (as ``bench_plan.py`` measures it)."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        alone = pool.apply(_spin, (n,))
        start = time.perf_counter()
        pool.map(_spin, [n, n])
        both = time.perf_counter() - start
    return 2 * alone / both


def answer(result: SimResult) -> tuple[Any, ...]:
    s = result.summary
    return (s.requests_completed, s.steps, s.output_tokens, s.ttft.p99, s.e2e.p50, s.span_s)


def scaling(args: Any) -> tuple[float, float]:
    """Part 1; returns (c_sim, c_draw)."""
    from inference_lab.executors.ray_backend import RayExecutor, local_cluster

    deployment, workload = fleet(args.replicas, args.window)
    start = time.perf_counter()
    with local_cluster(nodes=2, cpus_per_node=2) as address:
        print(f"Ray: 2 local nodes (2 CPUs each) up in {time.perf_counter() - start:.1f} s")
        executor = RayExecutor(run_shard, address)
        try:
            warm = attrs.evolve(workload, duration_secs=1.0)
            run_fleet(deployment, warm, executor, shards=4)  # starts the four workers
            rows = []
            for workers in args.workers:
                result = run_fleet(deployment, workload, executor, shards=workers)
                assert result.fleet is not None
                rows.append((workers, result))
                print(f"{workers} worker(s): {result.wall_time_s:.1f} s", flush=True)
        finally:
            executor.close()
    reference = answer(rows[0][1])
    assert all(answer(r) == reference for _, r in rows), "the shard counts disagree"
    requests = rows[0][1].summary.requests_completed
    print(
        f"\nscaling: {args.replicas} replicas x {args.window:g} s at {RATE:g}/s each = "
        f"{requests:,} requests, {rows[0][1].summary.steps:,} steps"
    )
    print(f"{'workers':>7} {'wall s':>8} {'speed-up':>8} {'shard CPU s':>24} {'req/s wall':>11}")
    one = rows[0][1].wall_time_s
    sim_cpu = draw_cpu = 0.0
    drawn = 0
    for workers, result in rows:
        assert result.fleet is not None
        cpus = [t.cpu_s for t in result.fleet.timings]
        sim_cpu += sum(t.cpu_s - t.select_cpu_s for t in result.fleet.timings)
        draw_cpu += sum(t.select_cpu_s for t in result.fleet.timings)
        drawn += requests * len(cpus)
        print(
            f"{workers:>7} {result.wall_time_s:>8.1f} {one / result.wall_time_s:>7.2f}x "
            f"{' / '.join(f'{c:.1f}' for c in cpus):>24} "
            f"{requests / result.wall_time_s:>11,.0f}"
        )
    c_sim = sim_cpu / (requests * len(rows))
    c_draw = draw_cpu / drawn
    print(
        f"\nper worker: {c_sim * 1e6:.1f} us CPU per simulated request "
        f"({1 / c_sim:,.0f} requests per CPU second), {c_draw * 1e9:.0f} ns per arrival "
        "drawn by a first pass"
    )
    return c_sim, c_draw


def projection(c_sim: float, c_draw: float) -> None:
    """Part 3."""
    per_replica = int(RATE * DAY_S)
    print(
        f"\nthe day: {DAY_REPLICAS} replicas x {RATE:g}/s x {DAY_S:,.0f} s = "
        f"{DAY_REQUESTS:,} requests ({per_replica:,} per replica)"
    )
    print(f"{'workers':>7} {'replicas/shard':>14} {'simulate s':>10} {'draw s':>8} {'day h':>7}")
    for workers in (16, 32, 64):
        share = DAY_REPLICAS / workers
        simulate = share * per_replica * c_sim
        draw = DAY_REQUESTS * c_draw
        print(
            f"{workers:>7} {share:>14g} {simulate:>10,.0f} {draw:>8,.0f} "
            f"{(simulate + draw) / 3600:>7.2f}"
        )


_DAY_SHARD = """\
import json, resource, sys, time
from inference_lab.sim.fleet import shard_jobs
from inference_lab.sim.shard import run_shard
sys.path.insert(0, sys.argv[1])
from bench_fleet import DAY_REPLICAS, DAY_S, fleet
deployment, workload = fleet(DAY_REPLICAS, DAY_S)
job = shard_jobs(deployment, workload, workload.seed, DAY_REPLICAS)[0]
start = time.perf_counter()
r = run_shard(job)
print(json.dumps({"wall": time.perf_counter() - start, "cpu": r.timing.cpu_s,
                  "draw_cpu": r.timing.select_cpu_s, "arrivals": r.stream_arrivals,
                  "own": r.arrivals, "completed": r.completed, "steps": r.steps,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def day_shard() -> None:
    """Part 4, in a fresh interpreter."""
    from pathlib import Path

    here = str(Path(__file__).resolve().parent)
    print("\none shard of the day (1 of 64 replicas), in a fresh interpreter ...", flush=True)
    proc = subprocess.run(
        [sys.executable, "-c", _DAY_SHARD, here], capture_output=True, text=True, check=True
    )
    d = json.loads(proc.stdout.splitlines()[-1])
    print(
        f"day shard: {d['arrivals']:,} arrivals drawn, {d['own']:,} its own, "
        f"{d['completed']:,} completed, {d['steps']:,} steps; wall {d['wall']:,.0f} s, "
        f"CPU {d['cpu']:,.0f} s (first pass {d['draw_cpu']:,.0f} s), peak RSS "
        f"{d['rss_mb']:,.0f} MB"
    )


def session_fleet(replicas: int, window: float, rate: float) -> tuple[Deployment, Workload]:
    """``replicas`` gpt-oss-20b / b200 replicas behind session_affinity, and
    chat-sessions-200's sessions starting at ``rate`` a second per replica for ``window``
    seconds."""
    deployment, _ = fleet(replicas, window)
    hw = attrs.evolve(deployment.hardware, router="session_affinity")
    chat = load_workload(shipped_dir("configs") / "workloads" / "chat-sessions-200.toml")
    assert chat.sessions is not None
    workload = attrs.evolve(
        chat,
        arrival_rate=rate * replicas,
        num_requests=None,
        duration_secs=window,
        sessions=attrs.evolve(chat.sessions, num_sessions=None),
    )
    return attrs.evolve(deployment, hardware=hw), workload


def _agree(one: SimResult, other: SimResult) -> None:
    """Part 5's check: the same counts, steps, tokens and span; p99s within the bound."""
    a, b = one.summary, other.summary
    exact = ("requests_completed", "requests_refused", "steps", "output_tokens", "span_s")
    assert all(getattr(a, k) == getattr(b, k) for k in exact), "the runs disagree"
    assert one.sessions is not None and other.sessions is not None
    assert one.sessions.turns == other.sessions.turns
    for x, y in ((a.ttft.p99, b.ttft.p99), (a.e2e.p99, b.e2e.p99)):
        assert x is not None and y is not None
        assert abs(x - y) <= RELATIVE_ACCURACY * abs(x) * (1 + 1e-9), (x, y)


def sessions(args: Any) -> None:
    """Part 5."""
    from inference_lab.executors.ray_backend import RayExecutor, local_cluster

    deployment, workload = session_fleet(args.replicas, args.window, args.session_rate)
    cpu = time.process_time()
    alone = run_simulation(deployment, workload)
    alone_cpu = time.process_time() - cpu
    assert alone.sessions is not None
    print(
        f"sessions: {args.replicas} replicas, {alone.sessions.sessions:,} sessions, "
        f"{alone.summary.requests_completed:,} turns, {alone.summary.steps:,} steps, "
        f"{alone.sim_time_s:,.0f} s simulated"
    )
    print(f"{'run':>12} {'wall s':>8} {'CPU s':>18}")
    print(f"{'unsharded':>12} {alone.wall_time_s:>8.1f} {alone_cpu:>18.1f}")
    with local_cluster(nodes=2, cpus_per_node=2) as address:
        executor = RayExecutor(run_shard, address)
        try:
            warm = attrs.evolve(workload, duration_secs=2.0)
            run_fleet(deployment, warm, executor, shards=4)  # starts the four workers
            for shards in (2, 4):
                result = run_fleet(deployment, workload, executor, shards=shards)
                _agree(alone, result)
                assert result.fleet is not None
                cpus = " / ".join(f"{t.cpu_s:.1f}" for t in result.fleet.timings)
                print(f"{f'{shards} shards':>12} {result.wall_time_s:>8.1f} {cpus:>18}")
        finally:
            executor.close()
    print("every run: the same completions, steps, tokens and span; p99s within the bound")


def _counts(text: str) -> list[int]:
    """``--workers``: integers >= 1, comma-separated."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"each value must be an integer >= 1, got {text!r}")
    return values


def main() -> int:
    parser = CliParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=integer(ge=1), default=8, help="default 8")
    parser.add_argument(
        "--window", type=number(gt=0), default=600.0, help="simulated seconds (default 600)"
    )
    parser.add_argument(
        "--workers",
        type=_counts,
        default=[1, 2, 4],
        help="shards (one per worker) to time, comma-separated (default 1,2,4)",
    )
    parser.add_argument(
        "--day-shard", action="store_true", help="also run one shard of the full day"
    )
    parser.add_argument(
        "--sessions", action="store_true", help="instead: sessions, unsharded and sharded"
    )
    parser.add_argument(
        "--session-rate",
        type=number(gt=0),
        default=1.0,
        help="--sessions: sessions started a second per replica (default 1)",
    )
    args = parser.parse_args()
    print(f"machine: two busy processes get {machine_parallelism():.2f} cores (before)")
    if args.sessions:
        sessions(args)
    else:
        c_sim, c_draw = scaling(args)
        projection(c_sim, c_draw)
    if args.day_shard and not args.sessions:
        day_shard()
    print(f"machine: two busy processes get {machine_parallelism():.2f} cores (after)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
