"""Benchmark: a multi-turn chat workload replayed against ``serve`` with ``load --sessions``,
per-turn TTFT from the client against the simulator's on the same sessions.

The session workload (default ``chat-sessions-200``: sessions of 8 turns on a shared
2,048-token system prompt) is simulated with ``inference-lab sim``'s engine, its sessions
are written as a session file (what ``sim --write-sessions`` writes), and the same
sessions are replayed by the load client (``inference_lab.client.replay``) against
``inference-lab serve`` of the same model and hardware, started here on 127.0.0.1. Each
turn resends the conversation, so the server's prefix cache sees what the simulator's
does. The table compares TTFT p50 (and the mean) per turn and the share of prompt tokens
found cached, client against simulator. A replayed turn is sent a think time after its
previous answer reached the client, not the simulator's think time after the simulated
answer, so the batches it meets differ a little; the second table compares the client with
the simulator run again on the replay's own requests (each arriving when the client sent
it, with the prompt and answer lengths the server reported): the model's TTFT for exactly
the traffic the server saw.

    python scripts/bench_sessions_serve.py [--config Llama-3.1-8B-Instruct] [--hardware h100]
        [--workload chat-sessions-200] [--sessions N] [--endpoint chat|completions]
        [--frontend-latency SECONDS]

``--frontend-latency`` sets ``[scheduler] frontend_latency`` for the simulator and the
server alike (a copy of the config with the key set is served).

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
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import attrs
import trio
from benchkit import ServerProcess

from inference_lab.client.replay import (
    ReplayConfig,
    ReplayResult,
    load_traffic,
    run_replay,
    summarize_replay,
)
from inference_lab.core.config import Deployment, load_deployment, load_workload
from inference_lab.core.engine import Engine, RequestSpec
from inference_lab.resources import resolve_shipped
from inference_lab.sim.run import run_simulation
from inference_lab.traffic.hashing import SyntheticStream
from inference_lab.traffic.sessions import (
    SessionRecord,
    shared_prefix,
    write_sessions,
)
from inference_lab.workload import session_records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="Llama-3.1-8B-Instruct")
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--workload", default="chat-sessions-200")
    parser.add_argument("--sessions", type=int, help="only the first N sessions")
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    parser.add_argument(
        "--frontend-latency", type=float, help="[scheduler] frontend_latency, in seconds"
    )
    args = parser.parse_args()
    if args.sessions is not None and args.sessions < 1:
        parser.error("--sessions must be >= 1")
    if args.frontend_latency is not None and not 0 <= args.frontend_latency <= 60:
        parser.error("--frontend-latency must be a number of seconds in 0..60")
    config_path = resolve_shipped(args.config, "config", "--config")
    keep = tempfile.TemporaryDirectory()  # the config's copy, until the server has read it
    if args.frontend_latency is not None:
        config_path = with_frontend_latency(config_path, args.frontend_latency, Path(keep.name))
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
        records = session_records(workload)
        count = write_sessions(path, records)
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
        + f", {args.endpoint}"
        + (
            f", frontend_latency {args.frontend_latency * 1e3:g} ms"
            if args.frontend_latency
            else ""
        )
        + f"; replay {wall:.0f} s; outcomes {summary['outcomes']}; "
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
    pairs = resimulate(deployment, records, result)
    print(
        "\nThe simulator again, each turn arriving when the client sent it "
        f"({len(pairs)} turns); TTFT in ms:"
    )
    print(
        f"{'turn':>4} {'n':>5} {'sim p50':>9} {'client p50':>10} {'error':>7}"
        f" {'sim mean':>9} {'client mean':>11} {'error':>7} {'|error| p50':>11}"
    )
    for turn in sorted({k for k, _, _ in pairs}):
        sims = [sv for k, sv, _ in pairs if k == turn]
        clients = [cv for k, _, cv in pairs if k == turn]
        sp50, cp50 = statistics.median(sims), statistics.median(clients)
        smean, cmean = sum(sims) / len(sims), sum(clients) / len(clients)
        each = statistics.median([abs(cv - sv) / sv for k, sv, cv in pairs if k == turn])
        print(
            f"{turn:>4} {len(sims):>5} {sp50:>9.2f} {cp50:>10.2f} {_err(cp50, sp50):>7}"
            f" {smean:>9.2f} {cmean:>11.2f} {_err(cmean, smean):>7} {each:>11.1%}"
        )
    return 0


def with_frontend_latency(config: Path, seconds: float, folder: Path) -> Path:
    """A copy of ``config`` in ``folder`` with ``[scheduler] frontend_latency`` set."""
    out = []
    found = False
    for line in config.read_text(encoding="utf-8").splitlines():
        if line.strip().startswith("frontend_latency"):
            continue
        out.append(line)
        if line.strip() == "[scheduler]":
            out.append(f"frontend_latency = {seconds!r}")
            found = True
    if not found:
        raise SystemExit(f"{config}: no [scheduler] table")
    copy = folder / config.name
    copy.write_text("\n".join(out) + "\n", encoding="utf-8")
    return copy


def resimulate(
    deployment: Deployment, sessions: list[SessionRecord], result: ReplayResult
) -> list[tuple[int, float, float]]:
    """(turn, simulated TTFT, client TTFT) in ms for every turn the replay completed. The
    simulated TTFT is an engine's for the same turns arriving at the replay's send times,
    each with the prompt and answer lengths the server reported (the resent answer text
    and the user text count a few per cent more tokens than the session plan's) over one
    token stream per conversation, as ``sim`` labels a session's blocks: so each turn finds
    cached what the server's did and prefills what the server's did."""
    sched = deployment.scheduler
    block = sched.block_size
    caching = sched.enable_prefix_caching
    by_session = {s.session: s for s in sessions}
    streams: dict[int, SyntheticStream] = {}
    shared = None
    done = sorted(
        (
            r
            for r in result.records
            if r.outcome == "ok"
            and r.sent is not None
            and r.ttft is not None
            and r.prompt_tokens
            and r.completion_tokens
        ),
        key=lambda r: r.sent or 0.0,
    )
    engine = Engine(deployment)
    client: dict[int, tuple[int, float]] = {}
    for r in done:
        assert r.sent is not None and r.ttft is not None
        assert r.prompt_tokens is not None and r.completion_tokens is not None
        chain: tuple[int, ...] = ()
        if caching:
            stream = streams.get(r.session)
            if stream is None:
                s = by_session[r.session]
                if s.shared_system_prompt and shared is None:
                    shared = shared_prefix(s.system_prompt_tokens, block)
                stream = SyntheticStream(
                    r.session,
                    block,
                    shared if s.shared_system_prompt else None,
                    s.system_prompt_tokens,
                )
                streams[r.session] = stream
            chain = stream.hashes(r.prompt_tokens + r.completion_tokens)
        rid = engine.submit(
            RequestSpec(
                prompt_tokens=r.prompt_tokens,
                max_tokens=r.completion_tokens,
                arrival_time=r.sent,
                block_hashes=chain,
            )
        )
        client[rid] = (r.turn, 1000 * r.ttft)
    out = []
    while engine.next_event_time() is not None:
        for f in engine.step().finished:
            turn, ttft = client[f.request_id]
            out.append((turn, 1000 * (f.first_token_time - f.arrival_time), ttft))
    return out


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
