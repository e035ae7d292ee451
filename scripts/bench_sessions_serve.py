"""Benchmark: a multi-turn chat workload replayed against ``serve`` with ``load --sessions``,
per-turn TTFT from the client against the simulator's on the same sessions.

The session workload (default ``chat-sessions-200``: sessions of 8 turns on a shared
2,048-token system prompt) is simulated with ``inference-lab sim``'s engine, its sessions
are written as a session file (what ``sim --write-sessions`` writes), and the same
sessions are replayed by the load client (``inference_lab.client.replay``) against
``inference-lab serve`` of the same model and hardware, started here on 127.0.0.1. Each
turn resends the conversation, so the server's prefix cache sees what the simulator's
does. The table compares TTFT p50 (and the mean) per turn and the share of prompt tokens
found cached, client against simulator.

    python scripts/bench_sessions_serve.py [--config Llama-3.1-8B-Instruct] [--hardware h100]
        [--workload chat-sessions-200] [--sessions N] [--endpoint chat|completions]

The prompts the server counts are not token for token the simulator's: the byte rule
counts the chat rendering (role prefixes, 5 % template overhead) and an answer resent as
text (about 1.07 byte-rule tokens per placeholder word); ``--endpoint completions``
avoids the template's part. Run it on a quiet machine: the client and the server share
the CPU.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import attrs
import trio
from benchkit import ServerProcess

from inference_lab.client.replay import ReplayConfig, load_traffic, run_replay, summarize_replay
from inference_lab.core.config import load_deployment, load_workload
from inference_lab.resources import resolve_shipped
from inference_lab.sim.run import run_simulation
from inference_lab.sim.workload import session_records
from inference_lab.traffic.sessions import write_sessions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="Llama-3.1-8B-Instruct")
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--workload", default="chat-sessions-200")
    parser.add_argument("--sessions", type=int, help="only the first N sessions")
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    args = parser.parse_args()
    if args.sessions is not None and args.sessions < 1:
        parser.error("--sessions must be >= 1")
    config_path = resolve_shipped(args.config, "config", "--config")
    deployment = load_deployment(config_path, args.hardware)
    workload = load_workload(resolve_shipped(args.workload, "workload", "--workload"))
    if workload.sessions is None:
        parser.error(f"{args.workload} has no [sessions] table")
    if args.sessions is not None:
        workload = attrs.evolve(
            workload,
            sessions=attrs.evolve(workload.sessions, num_sessions=args.sessions),
            num_requests=None,
        )
    start = time.perf_counter()
    sim = run_simulation(deployment, workload).to_dict()
    print(f"simulated in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    sim_turns = {row["turn"]: row for row in sim["sessions"]["by_turn"]}
    load1 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sessions.jsonl"
        count = write_sessions(path, session_records(workload))
        print(
            f"{count} sessions written; serving {args.config} on {args.hardware}", file=sys.stderr
        )
        with ServerProcess(["--config", str(config_path), "--hardware", args.hardware]) as server:
            config = ReplayConfig(
                url=server.url, model=deployment.model.name, sessions=path, endpoint=args.endpoint
            )
            t0 = time.perf_counter()
            result = trio.run(run_replay, config, load_traffic(config))
            wall = time.perf_counter() - t0
            server_ttft = _server_mean_ttft(server.url)
    load2 = os.getloadavg()[0]
    summary = summarize_replay(result)
    print(
        f"\n{args.config} on {args.hardware}, {args.workload}"
        + (f" (first {args.sessions} sessions)" if args.sessions else "")
        + f", {args.endpoint}; replay {wall:.0f} s; outcomes {summary['outcomes']}; "
        f"load average {load1:.2f} before, {load2:.2f} after; {os.cpu_count()} CPUs"
    )
    sim_mean = sim["latency_ms"]["ttft"]["mean"] if "latency_ms" in sim else float("nan")
    print(
        f"TTFT mean over every turn: simulator {sim_mean:.2f} ms, the server's engine "
        f"{server_ttft:.2f} ms (vllm:time_to_first_token_seconds), the client "
        f"{summary['all']['ttft_mean_ms']:.2f} ms"
    )
    print(
        f"{'turn':>4} {'n':>5} {'sim p50':>9} {'client p50':>10} {'error':>7}"
        f" {'sim mean':>9} {'client mean':>11} {'error':>7} {'cached sim':>10} {'client':>7}"
    )
    rows: list[tuple[Any, dict[str, Any], dict[str, Any]]] = [
        (row["turn"], sim_turns.get(row["turn"], {}), row) for row in summary["by_turn"]
    ]
    for turn, s, c in rows:
        if not s:
            continue
        sp50, smean = s["ttft_ms"]["p50"], s["ttft_ms"]["mean"]
        cp50, cmean = c["ttft_p50_ms"], c["ttft_mean_ms"]
        print(
            f"{turn:>4} {c['n']:>5} {sp50:>9.2f} {cp50:>10.2f} {_err(cp50, sp50):>7}"
            f" {smean:>9.2f} {cmean:>11.2f} {_err(cmean, smean):>7}"
            f" {s['cached_fraction']:>10.1%} {c['cached_share']:>7.1%}"
        )
    return 0


def _server_mean_ttft(url: str) -> float:
    """The server's own mean TTFT in ms, from its Prometheus histogram's sum and count."""
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:time_to_first_token_seconds_sum"):
            total += float(line.split()[-1])
        elif line.startswith("vllm:time_to_first_token_seconds_count"):
            count += float(line.split()[-1])
    return 1000 * total / count if count else float("nan")


def _err(got: float, want: float) -> str:
    if not (math.isfinite(got) and want):
        return "-"
    return f"{(got - want) / want:+.1%}"


if __name__ == "__main__":
    raise SystemExit(main())
