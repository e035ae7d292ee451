"""Benchmark ``inference-lab plan``'s backends on a 200-candidate space: one process, two
processes, and Ray tasks on a local cluster of two nodes (one CPU each, 127.0.0.1 only).

The space: gpt-oss-20b and Llama-3.1-8B-Instruct x b200, h200, h100, a100, mi300x x 1 or 2
replicas x max_num_seqs 16..256 x long_prefill_token_threshold 0 or 512 (candidates that
cannot run, such as fp4 weights on an A100, are reported without a job); short chat
requests, probes of --duration simulated seconds. Each backend starts from an empty cache
and must give the same answer as the others. Per backend it prints the wall time, the
jobs run, the speed-up over one process, and the overhead per task: (wall time x
workers - the jobs' own run time) / jobs, i.e. what each job costs beyond its simulation
(pickling, queues, scheduling, idle workers at the end). Before and after, it prints how
many cores two busy processes get on this machine at that moment (2.00 when it is idle),
since on a shared machine that, not the backend, bounds the speed-up.

    python scripts/bench_plan.py [--duration S] [--no-ray]
"""

from __future__ import annotations

import multiprocessing
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from inference_lab.cli_args import CliParser, number
from inference_lab.executors.backends import Executor, InlineExecutor, ProcessExecutor
from inference_lab.plan.cache import ResultCache
from inference_lab.plan.jobs import Job, ProbeResult, run_job
from inference_lab.plan.planner import PlanResult, run_plan
from inference_lab.plan.spec import expand_candidates, load_spec
from inference_lab.resources import shipped_dir

WORKLOAD = """\
arrival_pattern = "poisson"
arrival_rate = 10.0
num_requests = 100
input_len_dist = { type = "uniform", min = 32, max = 512 }
output_len_dist = { type = "uniform", min = 8, max = 64 }
seed = 11
"""


def spec_text(duration: float) -> str:
    configs = shipped_dir("configs")
    return f"""\
workload = "workload.toml"
models = ["{configs / "gpt-oss-20b.toml"}", "{configs / "Llama-3.1-8B-Instruct.toml"}"]
hardware = ["b200", "h200", "h100", "a100", "mi300x"]
replicas = [1, 2]

[scheduler]
max_num_seqs = [16, 32, 64, 128, 256]
long_prefill_token_threshold = [0, 512]

[search]
duration_s = {duration}
min_requests = 20
start_rate = 50
max_rate = 400
rel_tol = 0.2

[slo.chat]
ttft_p99_ms = 100
tpot_p99_ms = 20
"""


def _spin(n: int) -> float:
    start = time.perf_counter()
    total = 0
    for i in range(n):
        total += i * i
    return time.perf_counter() - start


def machine_parallelism(n: int = 20_000_000) -> float:
    """How many cores this machine gives two busy processes right now: 2.0 on an idle
    2-core machine, less when other work shares it (the same pure-Python loop, alone and
    then twice at once)."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        alone = pool.apply(_spin, (n,))
        start = time.perf_counter()
        pool.map(_spin, [n, n])
        both = time.perf_counter() - start
    return 2 * alone / both


def decisions(result: PlanResult) -> list[object]:
    return [
        (cr.candidate.index, name, o.max_rate, o.probes)
        for cr in result.candidates
        for name, o in sorted(cr.outcomes.items())
    ]


def run(
    name: str, make: Callable[[], Executor[Job, ProbeResult]], spec_path: Path, base: Path
) -> tuple[PlanResult, float, int]:
    spec = load_spec(spec_path)
    candidates = expand_candidates(spec)
    cache_dir = base / name
    executor = make()
    workers = executor.parallelism
    try:
        result = run_plan(spec, candidates, executor, ResultCache(cache_dir))
    finally:
        executor.close()
    cache = ResultCache(cache_dir)
    busy = 0.0
    for path in cache_dir.glob("*/*.npz"):
        entry = cache.get(path.stem)
        assert entry is not None
        busy += entry.wall_s
    return result, busy, workers


def main() -> int:
    parser = CliParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--duration",
        type=number(gt=0),
        default=0.5,
        help="simulated seconds of arrivals per probe (default 0.5)",
    )
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray run")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-plan-") as tmp:
        base = Path(tmp)
        (base / "workload.toml").write_text(WORKLOAD)
        spec_path = base / "plan.toml"
        spec_path.write_text(spec_text(args.duration))
        spec = load_spec(spec_path)
        cands = expand_candidates(spec)
        runnable = sum(1 for c in cands if c.deployment is not None)
        print(f"space: {len(cands)} candidates, {runnable} can run; probes of {args.duration:g} s")
        print(f"machine: two busy processes get {machine_parallelism():.2f} cores (before)")

        backends: list[tuple[str, Callable[[], Executor[Job, ProbeResult]]]] = [
            ("in-process", lambda: InlineExecutor(run_job)),
            ("1 process", lambda: ProcessExecutor(run_job, 1)),
            ("2 processes", lambda: ProcessExecutor(run_job, 2)),
        ]
        rows = []
        reference: list[object] | None = None
        for name, make in backends:
            result, busy, workers = run(name, make, spec_path, base)
            rows.append((name, result, busy, workers))
            print(f"{name}: {result.wall_s:.1f} s", flush=True)
            reference = reference or decisions(result)
            assert decisions(result) == reference, f"{name}: another answer"
        if not args.no_ray:
            from inference_lab.executors.ray_backend import RayExecutor, local_cluster

            start = time.perf_counter()
            with local_cluster(nodes=2) as address:
                up = time.perf_counter() - start
                print(f"Ray: 2 local nodes up in {up:.1f} s")
                result, busy, workers = run(
                    "Ray, 2 nodes", lambda: RayExecutor(run_job, address), spec_path, base
                )
            rows.append(("Ray, 2 nodes", result, busy, workers))
            assert decisions(result) == reference, "Ray: another answer"

    one = next(r for r in rows if r[0] == "1 process")[1].wall_s
    print(
        f"{'backend':<14} {'workers':>7} {'wall s':>8} {'jobs':>6} {'job time s':>10} "
        f"{'speed-up':>8} {'overhead/task ms':>16}"
    )
    for name, result, busy, workers in rows:
        jobs = result.jobs_run
        overhead = (result.wall_s * workers - busy) / jobs * 1e3 if jobs else 0.0
        print(
            f"{name:<14} {workers:>7} {result.wall_s:>8.1f} {jobs:>6} {busy:>10.1f} "
            f"{one / result.wall_s:>7.2f}x {overhead:>16.1f}"
        )
    print(f"machine: two busy processes get {machine_parallelism():.2f} cores (after)")
    print("every backend gave the same answer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
