"""Serve's five targets, measured with wrk from outside, and the per-request CPU budget.

Starts ``inference-lab serve`` as shipped (every shipped model on b200, every default
feature on: prefix caching, the dashboard, ``/metrics``), then per run measures with
``wrk`` (``scripts/wrk_stream.lua``: closed-loop streaming ``/v1/completions``, a
50-token prompt, every answer run to ``max_tokens``), each level after a warm-up run of
the same command:

1. **lone TTFT**: one connection, one-token answers (the first token is the last, so
   wrk's latency is the TTFT), mean against the model's prefill step + 0.5 ms;
2. **24, 64, 256 streams**: 200-token answers, wrk's median E2E against the engine's
   simulated median E2E of the same requests (those finished during wrk's measured run:
   ``/control/stats?finished=N``), within 1 %, 2 % and 3 %; the roofline's lock-step
   figure (every request admitted in one step, then 199 decode steps) is printed beside
   it;
3. **a 529 storm**: 200 refusals/s (a new connection each, from a process of their own:
   ``bench_overload.py``'s client) at Llama-3-70B, whose queue is held full, beside wrk's
   24 streams on gpt-oss-20b: the 529's p99 within 5 ms, and the streams' median E2E
   within 1 % of the 24-stream level's.

Each run records the load average (``uptime``) before it; each figure prints with its
target and whether it held. After the runs, the per-request CPU budget
(``bench_cpu_budget.py``'s cases and table) on the same server.

    python scripts/bench_targets.py                    # 3 runs, then the budget
    python scripts/bench_targets.py --runs 1 --duration 5 --no-budget

Needs ``wrk`` (Debian: ``apt-get install wrk``). Only 127.0.0.1 is contacted; every
level is bounded in time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import bench_cpu_budget
import numpy as np
import trio
from bench_overload import PINNED, Refusal, fire_elsewhere, hold_queue_full
from bench_serve import model_for_level
from benchkit import PROMPT_BYTES, ServerProcess, get_stats, model_entry, post_capacity

from inference_lab.core.config import Deployment, load_deployment
from inference_lab.core.roofline import Roofline
from inference_lab.resources import shipped_dir

MODEL = "gpt-oss-20b"
PROMPT = PROMPT_BYTES // 4  # 50 prompt tokens
OUTPUT = 200
LUA = Path(__file__).resolve().with_name("wrk_stream.lua")
STORM_RATE = 200.0


@attrs.frozen
class Figure:
    name: str
    measured: float  # ms, or per cent for the stream levels and the drift
    model: float  # what it is compared with (ms)
    limit: str
    held: bool
    note: str = ""


def wrk(url: str, connections: int, seconds: float, max_tokens: int) -> dict[str, Any]:
    """One wrk run of ``wrk_stream.lua``; its JSON line (latencies in microseconds)."""
    env = dict(os.environ, WRK_JSON="1", WRK_MAX_TOKENS=str(max_tokens), WRK_MODEL=MODEL)
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{math.ceil(seconds)}s", "--timeout", "30s"]
    cmd += ["-s", str(LUA), url + "/v1/completions"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=seconds + 60)
    line = next((x for x in done.stdout.splitlines() if x.startswith('{"requests"')), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed: {done.stderr.strip() or done.stdout.strip()}")
    figures: dict[str, Any] = json.loads(line)
    if figures["errors"]:
        raise RuntimeError(f"wrk -c{connections}: {figures['errors']} errors")
    return figures


def measured_level(url: str, connections: int, args: argparse.Namespace, tokens: int) -> Any:
    wrk(url, connections, args.warmup, tokens)  # warm-up: same command, discarded
    return wrk(url, connections, args.duration, tokens)


async def _finished(url: str) -> int:
    """How many requests the model's engine has finished."""
    return int(model_entry(await get_stats(url), MODEL)["finished"])


async def _simulated_e2e(url: str, count: int) -> float:
    """The median simulated E2E (ms) of the model's ``count`` latest completions: arrival
    stamp to finish on the engine's own timeline, what the pacing is to deliver."""
    answer = await get_stats(url, finished=count)
    return float(model_entry(answer, MODEL)["sim_e2e_ms"]["p50"])


def lone_ttft(dep: Deployment, url: str, args: argparse.Namespace) -> Figure:
    model_ms = float(Roofline(dep).step_time(np.array([PROMPT]), np.array([0]))) * 1e3
    got = measured_level(url, 1, args, 1)["mean"] / 1e3
    return Figure("lone TTFT", got, model_ms, "<= model + 0.5 ms", got <= model_ms + 0.5)


def stream_level(dep: Deployment, url: str, n: int, limit: float, args: argparse.Namespace) -> Any:
    """``n`` closed-loop streams: wrk's median E2E against the engine's simulated median E2E
    of the same requests (those that finished during wrk's measured run). The roofline's
    lock-step figure (every request admitted in one step) goes in the note: with many
    streams their arrivals spread over several steps, on any server, so the engine
    schedules them apart and their E2E moves away from it by the schedule, not the host."""
    lockstep = model_for_level(dep, n, dep.scheduler.max_num_seqs, PROMPT, OUTPUT)["e2e"] * 1e3
    wrk(url, n, args.warmup, OUTPUT)  # warm-up: same command, discarded
    before = trio.run(_finished, url)
    got = wrk(url, n, args.duration, OUTPUT)
    done = trio.run(_finished, url) - before
    model_ms = trio.run(_simulated_e2e, url, done)
    p50 = got["p50"] / 1e3
    error = (p50 - model_ms) / model_ms * 100
    figure = Figure(
        f"{n} streams", error, model_ms, f"within {limit:g} %", abs(error) <= limit,
        f"p50 {p50:.1f} ms, mean {got['mean'] / 1e3:.1f} ms, {got['requests']} req; lock-step"
        f" roofline {lockstep:.1f} ms ({(p50 - lockstep) / lockstep * 100:+.2f} %)",
    )  # fmt: skip
    return figure, got


async def _storm(url: str, port: int, args: argparse.Namespace) -> tuple[list[Refusal], int]:
    """Hold Llama-3-70B's queue full and fire refusals at it at STORM_RATE for the
    warm-up and the measured seconds."""
    refusals: list[Refusal] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(hold_queue_full, "127.0.0.1", port)
        start = time.perf_counter() + 0.5
        dropped = await fire_elsewhere(
            "127.0.0.1", port, STORM_RATE, start, start + args.warmup + args.duration, refusals
        )
        nursery.cancel_scope.cancel()
    cut = start + args.warmup
    return [r for r in refusals if r.start >= cut], dropped


def storm(url: str, base_p50_ms: float, args: argparse.Namespace) -> list[Figure]:
    """The storm beside wrk's 24 streams (wrk runs in its own process meanwhile)."""
    port = int(url.rsplit(":", 1)[1])
    env = dict(os.environ, WRK_JSON="1", WRK_MAX_TOKENS=str(OUTPUT), WRK_MODEL=MODEL)
    seconds = math.ceil(args.warmup + args.duration + 0.5)  # wrk takes whole seconds
    cmd = ["wrk", "-t1", "-c24", f"-d{seconds}s", "--timeout", "30s", "-s", str(LUA)]
    proc = subprocess.Popen(
        [*cmd, url + "/v1/completions"], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        refusals, dropped = trio.run(_storm, url, port, args)
    finally:
        out, _ = proc.communicate(timeout=seconds + 60)
    line = next((x for x in out.splitlines() if x.startswith('{"requests"')), None)
    if line is None:
        raise RuntimeError(f"wrk beside the storm printed no figures: {out.strip()}")
    streams = json.loads(line)
    answered = [r.latency * 1e3 for r in refusals if r.status == 529]
    missing = len(refusals) - len(answered) + dropped
    p99 = float(np.percentile(answered, 99)) if answered else math.nan
    drift = (streams["p50"] / 1e3 - base_p50_ms) / base_p50_ms * 100
    rate = len(answered) / args.duration
    return [
        Figure(
            "529 p99 in the storm", p99, 5.0, "<= 5 ms", p99 <= 5.0 and missing == 0,
            f"{rate:.0f} refusals/s, {missing} not 529",
        ),
        Figure(
            "24 streams' drift", drift, base_p50_ms, "within 1 %", abs(drift) <= 1.0,
            f"E2E p50 {streams['p50'] / 1e3:.1f} ms against {base_p50_ms:.1f} ms (wrk, the storm's"
            " warm-up included)",
        ),
    ]  # fmt: skip


def one_run(dep: Deployment, url: str, args: argparse.Namespace) -> list[Figure]:
    figures = [lone_ttft(dep, url, args)]
    base_p50 = math.nan
    for n, limit in ((24, 1.0), (64, 2.0), (256, 3.0)):
        figure, got = stream_level(dep, url, n, limit, args)
        figures.append(figure)
        if n == 24:
            base_p50 = got["p50"] / 1e3
    figures.extend(storm(url, base_p50, args))
    return figures


def print_run(k: int, load: tuple[float, float, float], figures: list[Figure]) -> None:
    print(f"\nrun {k}: load average before {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    for f in figures:
        unit = "%" if f.name.endswith("streams") or "drift" in f.name else "ms"
        value = f"{f.measured:+.2f} %" if unit == "%" else f"{f.measured:.2f} ms"
        model = f"(model {f.model:.2f} ms)" if "529" not in f.name else ""
        verdict = "held" if f.held else "MISSED"
        print(f"  {f.name:<22}{value:>11} {model:<20} target {f.limit:<18} {verdict:<7}{f.note}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--duration", type=float, default=10.0, help="measured s per level")
    parser.add_argument("--warmup", type=float, default=3.0, help="warm-up s per level")
    parser.add_argument("--no-budget", action="store_true", help="skip the CPU budget")
    parser.add_argument("--budget-requests", type=int, default=480)
    args = parser.parse_args(argv)
    if args.runs < 1 or args.budget_requests < 24:
        parser.error("--runs must be at least 1 and --budget-requests at least 24")
    if not (args.duration > 0 and args.warmup > 0):
        parser.error("--duration and --warmup must be positive")
    if shutil.which("wrk") is None:
        parser.exit(2, "bench_targets: wrk is not installed (Debian: apt-get install wrk)\n")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dep = load_deployment(shipped_dir("configs") / f"{MODEL}.toml", "b200")
    runs: list[list[Figure]] = []
    with ServerProcess(["--hardware", "b200"]) as server:
        assert server.proc is not None
        trio.run(lambda: post_capacity(server.url, model=PINNED, max_num_seqs=1, max_waiting=1))
        for k in range(1, args.runs + 1):
            load = os.getloadavg()
            figures = one_run(dep, server.url, args)
            runs.append(figures)
            print_run(k, load, figures)
            sys.stdout.flush()
        held = [all(f.held for f in run) for run in runs]
        print(f"\nruns with every target held: {sum(held)} of {len(runs)}")
        for i, name in enumerate(f.name for f in runs[0]):
            values = [run[i].measured for run in runs]
            kept = sum(run[i].held for run in runs)
            print(
                f"  {name:<22} held {kept} of {len(runs)}; median {statistics.median(values):.2f}"
            )
        if not args.no_budget:
            budget = bench_cpu_budget.parse_args(
                ["--config", MODEL, "--requests", str(args.budget_requests)]
            )
            port = int(server.url.rsplit(":", 1)[1])
            trio.run(bench_cpu_budget.main_async, budget, port, server.proc.pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
