"""Benchmark the offline simulator: poisson-50rps-4000 on Llama-3-70B / b200, no progress bar.

Prints wall time, simulated steps, simulated steps/s and simulated output tokens/s (the
rate at which the simulator produces tokens, per real second), plus the peak waiting queue
and preemptions. The target is a total wall time under 5.5 s.

    python scripts/bench_sim.py [--repeat N] [--config PATH] [--hardware NAME] [--workload PATH]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from inference_lab.cli_args import CliParser, integer
from inference_lab.core.config import load_deployment, load_workload
from inference_lab.errors import ConfigError
from inference_lab.resources import shipped_dir
from inference_lab.sim.run import run_simulation

TARGET_S = 5.5


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
    args = parser.parse_args()

    worst = 0.0
    for i in range(args.repeat):
        start = time.perf_counter()
        try:
            deployment = load_deployment(args.config, args.hardware)
            workload = load_workload(args.workload)
        except ConfigError as exc:
            print(f"bench_sim: {exc}", file=sys.stderr)
            return 2
        result = run_simulation(deployment, workload)
        wall = time.perf_counter() - start
        worst = max(worst, wall)
        s = result.summary
        print(
            f"run {i + 1}: {args.config.name} [{args.hardware}] x {args.workload.name}\n"
            f"  wall time            {wall:8.3f} s (loop {result.wall_time_s:.3f} s)\n"
            f"  simulated steps      {s.steps:8,d}\n"
            f"  steps/s              {s.steps / result.wall_time_s:8,.0f}\n"
            f"  output tokens/s      {s.output_tokens / result.wall_time_s:8,.0f} "
            f"(simulated tokens per real second)\n"
            f"  simulated time       {result.sim_time_s:8.3f} s\n"
            f"  completed / refused  {s.requests_completed:,} / {s.requests_refused:,}\n"
            f"  peak waiting queue   {result.peak_waiting:8,d}\n"
            f"  preemptions          {s.preemptions:8,d}"
        )
    verdict = "ok" if worst < TARGET_S else "TOO SLOW"
    print(f"worst wall time {worst:.3f} s (target < {TARGET_S} s): {verdict}")
    return 0 if worst < TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
