"""Benchmark the offline simulator: poisson-50rps-4000 on Llama-3-70B / b200, no progress bar.

Prints wall time, CPU time, simulated steps, simulated steps/s, simulated requests/s and
simulated output tokens/s (the rate at which the simulator produces them, per real
second), plus the peak waiting queue and preemptions. The target is a total wall time
under 5.5 s.

``--compare-with DIR`` times the same run with the ``inference_lab`` package found in DIR
(another checkout, e.g. ``git worktree add /tmp/base <commit>``) in alternating
subprocesses, and prints both sides' best CPU and wall times and their ratio: a
before / after measurement on one machine in one run.

    python scripts/bench_sim.py [--repeat N] [--config PATH] [--hardware NAME] [--workload PATH]
                                [--compare-with DIR]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from inference_lab.cli_args import CliParser, integer
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
        "completed": s.requests_completed,
        "refused": s.requests_refused,
        "output_tokens": s.output_tokens,
        "sim_time": result.sim_time_s,
        "peak_waiting": result.peak_waiting,
        "preemptions": s.preemptions,
    }


_CHILD = """\
import json, sys, time
from inference_lab.core.config import load_deployment, load_workload
from inference_lab.sim.run import run_simulation
start, cpu = time.perf_counter(), time.process_time()
result = run_simulation(load_deployment(sys.argv[1], sys.argv[2]), load_workload(sys.argv[3]))
print(json.dumps({"wall": time.perf_counter() - start, "cpu": time.process_time() - cpu,
                  "steps": result.summary.steps,
                  "completed": result.summary.requests_completed}))
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
        print(
            f"{name}: best CPU {min(r['cpu'] for r in runs):.3f} s, best wall "
            f"{min(r['wall'] for r in runs):.3f} s (CPU of each run: {cpus})"
        )
    cpu_ratio = min(r["cpu"] for r in this) / min(r["cpu"] for r in other)
    wall_ratio = min(r["wall"] for r in this) / min(r["wall"] for r in other)
    print(f"this / base: CPU {cpu_ratio:.3f}, wall {wall_ratio:.3f} ({repeat} runs each)")
    return 0


def main() -> int:
    parser = CliParser(description=__doc__.splitlines()[0])
    configs = shipped_dir("configs")
    parser.add_argument("--config", type=Path, default=configs / "Llama-3-70B.toml")
    parser.add_argument("--hardware", default="b200")
    parser.add_argument(
        "--workload", type=Path, default=configs / "workloads" / "poisson-50rps-4000.toml"
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
    try:
        load_deployment(args.config, args.hardware)
        load_workload(args.workload)
    except ConfigError as exc:
        print(f"bench_sim: {exc}", file=sys.stderr)
        return 2
    if args.compare_with is not None:
        runs = [str(args.config.resolve()), args.hardware, str(args.workload.resolve())]
        return compare(args.compare_with.resolve(), runs, args.repeat)

    worst = 0.0
    for i in range(args.repeat):
        r = _one_run(args.config, args.hardware, args.workload)
        worst = max(worst, r["wall"])
        loop = r["loop"]
        print(
            f"run {i + 1}: {args.config.name} [{args.hardware}] x {args.workload.name}\n"
            f"  wall time            {r['wall']:8.3f} s (loop {loop:.3f} s, CPU {r['cpu']:.3f} s)\n"
            f"  simulated steps      {int(r['steps']):8,d}\n"
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
