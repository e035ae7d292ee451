"""Benchmark the offline simulator: poisson-50rps-4000 on Llama-3-70B / b200, no progress bar.

Prints wall time, CPU time, simulated steps, simulated steps/s, simulated requests/s and
simulated output tokens/s (the rate at which the simulator produces them, per real
second), plus the peak waiting queue and preemptions. The target is a total wall time
under 5.5 s.

``--compare-with DIR`` times the same run with the ``inference_lab`` package found in DIR
(another checkout, e.g. ``git worktree add /tmp/base <commit>``) in alternating
subprocesses, and prints both sides' best CPU and wall times and their ratio: a
before / after measurement on one machine in one run.

``--requests N`` is the scale benchmark: ``poisson-50rps-4000.toml``'s lengths and seed at
``--rate`` (default 200 requests/s) and N requests on gpt-oss-20b / b200, a loaded
deployment: it completes about 240 requests/s of this mix, so at 200/s its batches hold
about 200 requests and its queue stays short, ~1.7 engine steps per request
(``--workload``, ``--config`` and ``--hardware`` replace them). Each run is in a fresh
interpreter and prints wall time, CPU time, steps, engine events, steps/s and the peak RSS
of that interpreter (so that the sides' peaks do not mix); with ``--compare-with DIR`` the
two checkouts alternate as above.

    python scripts/bench_sim.py [--repeat N] [--config PATH] [--hardware NAME] [--workload PATH]
                                [--requests N [--rate R]] [--compare-with DIR]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from inference_lab.cli_args import CliParser, integer, number
from inference_lab.core.config import load_deployment, load_workload
from inference_lab.errors import ConfigError
from inference_lab.resources import shipped_dir
from inference_lab.sim.run import run_simulation

TARGET_S = 5.5


def _one_run(config: Path, hardware: str, workload_path: Path) -> dict[str, float]:
    """One simulation from loading to the end: wall and CPU seconds and the counts."""
    start, cpu = time.perf_counter(), time.process_time()
    deployment = load_deployment(config, hardware)
    workload = load_workload(workload_path)
    result = run_simulation(deployment, workload)
    s = result.summary
    return {
        "wall": time.perf_counter() - start,
        "cpu": time.process_time() - cpu,
        "loop": result.wall_time_s,
        "steps": s.steps,
        "events": s.steps + s.requests_completed + s.requests_refused,
        "completed": s.requests_completed,
        "refused": s.requests_refused,
        "output_tokens": s.output_tokens,
        "sim_time": result.sim_time_s,
        "peak_waiting": result.peak_waiting,
        "preemptions": s.preemptions,
    }


_CHILD = """\
import json, resource, sys, time
import attrs
from inference_lab.core.config import load_deployment, load_workload
from inference_lab.sim.run import run_simulation
start, cpu = time.perf_counter(), time.process_time()
workload = load_workload(sys.argv[3])
if len(sys.argv) > 4:
    workload = attrs.evolve(workload, num_requests=int(sys.argv[4]), arrival_rate=float(sys.argv[5]))
result = run_simulation(load_deployment(sys.argv[1], sys.argv[2]), workload)
print(json.dumps({"wall": time.perf_counter() - start, "cpu": time.process_time() - cpu,
                  "steps": result.summary.steps,
                  "events": result.summary.steps + result.summary.requests_completed
                  + result.summary.requests_refused,
                  "completed": result.summary.requests_completed,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _child_run(package_dir: Path, args: list[str]) -> dict[str, float]:
    """One run in a fresh interpreter whose ``inference_lab`` is the one in
    ``package_dir`` (the code above uses only what every checkout has)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(package_dir)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        cwd=package_dir,
    )
    if out.returncode != 0:
        raise SystemExit(f"bench_sim: a run failed:\n{out.stderr}")
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def compare(base: Path, args: list[str], repeat: int) -> int:
    """Alternate runs of this checkout and ``base``; print the best of each and the
    ratio (this / base)."""
    if not (base / "inference_lab" / "__init__.py").is_file():
        print(f"bench_sim: {base}: no inference_lab package there", file=sys.stderr)
        return 2
    here = Path(__file__).resolve().parent.parent
    sides: dict[str, list[dict[str, float]]] = {"this": [], "base": []}
    order = [("this", here), ("base", base)]
    for i in range(repeat):
        for name, pkg in order if i % 2 == 0 else order[::-1]:
            sides[name].append(_child_run(pkg, args))
    this, other = sides["this"], sides["base"]
    if this[0]["steps"] != other[0]["steps"] or this[0]["completed"] != other[0]["completed"]:
        print("bench_sim: the two checkouts simulate different runs", file=sys.stderr)
    for name, runs in (("this checkout", this), (f"base {base}", other)):
        cpus = ", ".join(f"{r['cpu']:.3f}" for r in runs)
        rss = f", peak RSS {max(r['rss_mb'] for r in runs):,.0f} MB" if "rss_mb" in runs[0] else ""
        print(
            f"{name}: best CPU {min(r['cpu'] for r in runs):.3f} s, best wall "
            f"{min(r['wall'] for r in runs):.3f} s{rss}; {int(runs[0]['steps']):,} steps "
            f"(CPU of each run: {cpus})"
        )
    cpu_ratio = min(r["cpu"] for r in this) / min(r["cpu"] for r in other)
    wall_ratio = min(r["wall"] for r in this) / min(r["wall"] for r in other)
    print(f"this / base: CPU {cpu_ratio:.3f}, wall {wall_ratio:.3f} ({repeat} runs each)")
    return 0


def scale(args: list[str], repeat: int) -> int:
    """``--requests N`` without a base: each run in a fresh interpreter (its own peak RSS)."""
    here = Path(__file__).resolve().parent.parent
    for i in range(repeat):
        r = _child_run(here, args)
        print(
            f"run {i + 1}: {Path(args[0]).name} [{args[1]}] x {Path(args[2]).name}, "
            f"{int(args[3]):,} requests at {float(args[4]):g}/s\n"
            f"  wall time            {r['wall']:8.3f} s\n"
            f"  CPU time             {r['cpu']:8.3f} s\n"
            f"  simulated steps      {int(r['steps']):8,d}\n"
            f"  engine events        {int(r['events']):8,d}  (arrivals + step boundaries)\n"
            f"  steps/s (CPU)        {r['steps'] / r['cpu']:8,.0f}\n"
            f"  completed            {int(r['completed']):8,d}\n"
            f"  peak RSS             {r['rss_mb']:8,.0f} MB"
        )
    return 0


def main() -> int:
    parser = CliParser(description=__doc__.splitlines()[0])
    configs = shipped_dir("configs")
    parser.add_argument(
        "--config", type=Path, help="default Llama-3-70B (gpt-oss-20b with --requests)"
    )
    parser.add_argument("--hardware", default="b200")
    parser.add_argument(
        "--workload",
        type=Path,
        help="default poisson-50rps-4000.toml",
    )
    parser.add_argument(
        "--requests",
        type=integer(ge=1),
        metavar="N",
        help="the scale benchmark: the workload with N requests, peak RSS per run",
    )
    parser.add_argument(
        "--rate",
        type=number(gt=0),
        default=200.0,
        help="with --requests: the arrival rate, requests/s (default 200)",
    )
    parser.add_argument(
        "--repeat", type=integer(ge=1), default=1, help="run this many times (default 1)"
    )
    parser.add_argument(
        "--compare-with",
        type=Path,
        metavar="DIR",
        help="also time the inference_lab package in DIR, alternating (before / after)",
    )
    args = parser.parse_args()
    if args.config is None:
        name = "gpt-oss-20b.toml" if args.requests is not None else "Llama-3-70B.toml"
        args.config = configs / name
    if args.workload is None:
        args.workload = configs / "workloads" / "poisson-50rps-4000.toml"
    try:
        load_deployment(args.config, args.hardware)
        load_workload(args.workload)
    except ConfigError as exc:
        print(f"bench_sim: {exc}", file=sys.stderr)
        return 2
    runs = [str(args.config.resolve()), args.hardware, str(args.workload.resolve())]
    if args.requests is not None:
        runs += [str(args.requests), str(args.rate)]
    if args.compare_with is not None:
        return compare(args.compare_with.resolve(), runs, args.repeat)
    if args.requests is not None:
        return scale(runs, args.repeat)

    worst = 0.0
    for i in range(args.repeat):
        r = _one_run(args.config, args.hardware, args.workload)
        worst = max(worst, r["wall"])
        loop = r["loop"]
        print(
            f"run {i + 1}: {args.config.name} [{args.hardware}] x {args.workload.name}\n"
            f"  wall time            {r['wall']:8.3f} s (loop {loop:.3f} s, CPU {r['cpu']:.3f} s)\n"
            f"  simulated steps      {int(r['steps']):8,d}\n"
            f"  engine events        {int(r['events']):8,d}  (arrivals + step boundaries)\n"
            f"  steps/s              {r['steps'] / loop:8,.0f}\n"
            f"  requests/s           {r['completed'] / loop:8,.0f} (simulated requests per "
            f"real second)\n"
            f"  output tokens/s      {r['output_tokens'] / loop:8,.0f} "
            f"(simulated tokens per real second)\n"
            f"  simulated time       {r['sim_time']:8.3f} s\n"
            f"  completed / refused  {int(r['completed']):,} / {int(r['refused']):,}\n"
            f"  peak waiting queue   {int(r['peak_waiting']):8,d}\n"
            f"  preemptions          {int(r['preemptions']):8,d}"
        )
    verdict = "ok" if worst < TARGET_S else "TOO SLOW"
    print(f"worst wall time {worst:.3f} s (target < {TARGET_S} s): {verdict}")
    return 0 if worst < TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
