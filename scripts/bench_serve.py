"""Benchmark serve mode against the roofline: closed-loop streams through real HTTP.

Starts ``inference-lab serve`` (gpt-oss-20b on b200 by default) in its own process, so
that on a machine of two cores or more the server and this client each get a core,
unless ``--url`` points at a running server. Each level runs C closed-loop clients, each streaming ``/v1/completions``
requests (a 200-byte prompt = 50 prompt tokens, ``max_tokens`` 200) back to back on one
keep-alive connection; the level ``24>8`` runs 24 clients after a live
``POST /control/capacity {"max_num_seqs": 8}``. Beside the closed loop, a probe client
sends a one-token streaming request every ``--probe-every`` seconds and times its first
token. A server the script started itself first answers one request on a fresh
connection, timed as "the first request after start". Per level it prints, after a warm-up (each client's first request is dropped):

- client TTFT p50 and E2E p50 (send -> last byte), and the roofline's E2E for the level
  (all requests in lock-step: one prefill step, then 199 decode steps; with fewer slots
  than clients, ceil(C / S) such waves), with the error of the measurement;
- the probe's TTFT p50 against the model's for it (half a decode step of waiting for the
  next step boundary, then the step that carries its prefill beside the batch's decodes);
- ITL as the client sees it: the gap between successive writes (p50 / p90) and the tokens
  per write, against the model's decode step — how much delivery was coalesced;
- the server's CPU (process time over wall time) and its pacing lag (mean, p99);
- the share of this machine's CPU time the hypervisor took for other work meanwhile
  (``steal`` in ``/proc/stat``; "-" where there is none): above a few per cent the
  machine was slowed from outside while the level ran.

The client is deliberately raw (trio sockets, no HTTP parser) so it stays cheap next to the
server. Only 127.0.0.1 (or the given URL) is contacted; every level is bounded in time.

    python scripts/bench_serve.py                       # 1, 24, 64, 256, 24>8
    python scripts/bench_serve.py --levels 24 --duration 20
    python scripts/bench_serve.py --levels 24 --scrape-every 0.1   # does /metrics disturb?

With ``--fresh-servers N`` it runs no levels: it starts N servers in turn and times each
one's first request after start (``--idle`` seconds after it is healthy, on a new
connection, from a blocking socket: a client outside any event loop), then prints how many
were within the targets (TTFT within 1 ms of the model's, E2E within 1 ms + 1 % of the
roofline's).

    python scripts/bench_serve.py --fresh-servers 10
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import statistics
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import trio
from benchkit import (
    PROMPT_BYTES,
    Result,
    ServerProcess,
    blocking_stream,
    client_loop,
    completion_request,
    get_stats,
    machine_steal,
    model_entry,
    one_stream,
    post_capacity,
    request_json,
    scrape_loop,
    steal_pct,
)

from inference_lab.core.config import Deployment, load_deployment
from inference_lab.core.roofline import Roofline
from inference_lab.errors import ConfigError
from inference_lab.resources import shipped_dir

PROMPT = PROMPT_BYTES // 4


# ---------------------------------------------------------------------------------------
# predictions


def _step(roof: Roofline, n: list[int], c: list[int]) -> float:
    return float(roof.step_time(np.array(n, dtype=np.int64), np.array(c, dtype=np.int64)))


def roofline_lockstep_e2e(dep: Deployment, batch: int, prompt: int, output: int) -> float:
    """E2E of ``batch`` identical requests moving in lock-step: one prefill step, then
    ``output - 1`` decode steps of the whole batch."""
    roof = Roofline(dep)
    total = _step(roof, [prompt] * batch, [0] * batch)
    for k in range(1, output):
        total += _step(roof, [1] * batch, [prompt + k - 1] * batch)
    return total


def model_for_level(
    dep: Deployment, clients: int, seqs: int, prompt: int, output: int
) -> dict[str, float]:
    """The roofline's E2E, decode step and probe TTFT for ``clients`` closed-loop clients
    and ``seqs`` batch slots (seconds)."""
    batch = min(clients, seqs)
    roof = Roofline(dep)
    waves = math.ceil(clients / seqs)
    ctx = prompt + output // 2
    t_dec = _step(roof, [1] * batch, [ctx] * batch)
    # the probe's prefill (its prompt) rides on a step beside the batch's decodes
    t_mix = _step(roof, [1] * batch + [prompt], [ctx] * batch + [0]) if clients > 1 else 0.0
    return {
        "e2e": waves * roofline_lockstep_e2e(dep, batch, prompt, output),
        "step": t_dec,
        # with a queue (more clients than slots) the probe waits behind it: no figure
        "probe_ttft": (
            math.nan
            if clients > seqs
            else t_dec / 2 + t_mix
            if clients > 1
            else _step(roof, [prompt], [0])
        ),
    }


# ---------------------------------------------------------------------------------------
# the probe


async def probe_loop(
    host: str, port: int, model: str, every: float, stop_at: float, ttfts: list[float]
) -> None:
    """A lone extra client: a one-token streaming request every ``every`` seconds."""
    request = completion_request(host, model, 1)
    stream = await trio.open_tcp_stream(host, port)
    try:
        while time.perf_counter() + every < stop_at:
            await trio.sleep(every)
            result = await one_stream(stream, request, time.perf_counter())
            if result.status == 200:
                ttfts.append(result.ttft)
    finally:
        await stream.aclose()


# ---------------------------------------------------------------------------------------
# the first request after start


def lone_request_model(dep: Deployment, max_tokens: int) -> tuple[float, float]:
    """The model's TTFT and the roofline's E2E for a lone request (seconds)."""
    return _step(Roofline(dep), [PROMPT], [0]), roofline_lockstep_e2e(dep, 1, PROMPT, max_tokens)


async def first_request(url: str, model: str, dep: Deployment, max_tokens: int) -> str:
    """One streaming request on a fresh connection to a server that has served no
    completion yet: its TTFT and E2E against the model's for a lone request."""
    parsed = urllib.parse.urlsplit(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    stream = await trio.open_tcp_stream(host, port)
    try:
        with trio.fail_after(30):
            result = await one_stream(
                stream, completion_request(host, model, max_tokens), time.perf_counter()
            )
    finally:
        await stream.aclose()
    if result.status != 200:
        return f"first request after start: HTTP {result.status}"
    ttft, e2e = lone_request_model(dep, max_tokens)
    return (
        f"first request after start (new connection): TTFT {result.ttft * 1000:.2f} ms "
        f"(model {ttft * 1000:.2f}), E2E {result.e2e * 1000:.1f} ms (roofline "
        f"{e2e * 1000:.1f}, {(result.e2e - e2e) / e2e * 100:+.2f} %)"
    )


def first_requests(args: argparse.Namespace, dep: Deployment) -> list[dict[str, Any]]:
    """``--fresh-servers``: the first request after start of that many servers, each
    started, idle for ``args.idle`` seconds, asked once and stopped in turn."""
    ttft_model, e2e_model = lone_request_model(dep, args.max_tokens)
    config = ["--config", str(shipped_dir("configs") / f"{args.model}.toml")]
    print(
        f"bench_serve: the first request after start of {args.fresh_servers} fresh servers "
        f"({args.model} on {args.hardware}, {PROMPT}-token prompt, {args.max_tokens} tokens "
        f"streamed; {args.idle:g} s idle after start; a new connection from a blocking socket)",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    for i in range(args.fresh_servers):
        with ServerProcess([*config, "--hardware", args.hardware], log=Path(os.devnull)) as server:
            parsed = urllib.parse.urlsplit(server.url)
            host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
            time.sleep(args.idle)  # an idle server: what a first client meets
            with socket.create_connection((host, port), timeout=30) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                result = blocking_stream(
                    sock, completion_request(host, args.model, args.max_tokens)
                )
        if result.status != 200:
            raise RuntimeError(f"server {i + 1}: the first request got HTTP {result.status}")
        row = {"server": i + 1, "ttft_ms": result.ttft * 1e3, "e2e_ms": result.e2e * 1e3}
        rows.append(row)
        print(
            f"  server {i + 1:>2}: TTFT {row['ttft_ms']:.2f} ms, E2E {row['e2e_ms']:.1f} ms "
            f"({(result.e2e - e2e_model) / e2e_model * 100:+.2f} %)",
            flush=True,
        )
    ttfts = sorted(r["ttft_ms"] for r in rows)
    ttft_ok = sum(t <= (ttft_model + 0.001) * 1e3 for t in ttfts)
    e2e_ok = sum(r["e2e_ms"] <= (e2e_model * 1.01 + 0.001) * 1e3 for r in rows)
    n = len(rows)
    print(
        f"TTFT min {ttfts[0]:.2f} / median {statistics.median(ttfts):.2f} / max {ttfts[-1]:.2f} "
        f"ms (model {ttft_model * 1e3:.2f}): within 1 ms of the model in {ttft_ok} of {n}; "
        f"E2E within 1 ms + 1 % of the roofline's {e2e_model * 1e3:.1f} ms in {e2e_ok} of {n}",
        flush=True,
    )
    return rows


# ---------------------------------------------------------------------------------------
# a level


@attrs.frozen
class LevelReport:
    level: str
    clients: int
    seqs: int
    requests: int
    ttft_p50_ms: float
    e2e_p50_ms: float
    roofline_ms: float
    error_pct: float
    probe_ttft_p50_ms: float
    probe_model_ms: float
    itl_p50_ms: float
    itl_p90_ms: float
    tokens_per_write: float
    step_ms: float
    tokens_per_s: float
    server_cpu_pct: float
    steal_pct: float
    lag_mean_ms: float
    lag_p99_ms: float
    errors: int


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


async def run_level(
    url: str,
    model: str,
    dep: Deployment,
    level: str,
    args: argparse.Namespace,
    scrape_every: float = 0.0,
) -> LevelReport:
    parsed = urllib.parse.urlsplit(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    clients, _, limited = level.partition(">")
    clients_n = int(clients)
    original_seqs = model_entry(await get_stats(url), model)["max_num_seqs"]
    seqs = int(limited) if limited else original_seqs
    model_fig = model_for_level(dep, clients_n, seqs, PROMPT, args.max_tokens)
    request = completion_request(host, model, args.max_tokens)
    delays = np.random.default_rng(1).uniform(0.0, model_fig["e2e"], clients_n)
    results: list[Result] = []
    probe: list[float] = []
    scrapes: list[float] = []
    start = time.perf_counter()
    warmup = 2 * model_fig["e2e"] + 0.5
    stop_at = start + warmup + args.duration
    measured_from = start + warmup
    before: dict[str, Any] = {}
    steal_before: list[tuple[int, int] | None] = [None]

    async def measure_window() -> None:
        await trio.sleep(warmup)
        steal_before[0] = machine_steal()
        before.update(await get_stats(url))

    with trio.fail_after(warmup + args.duration + 120):
        async with trio.open_nursery() as nursery:
            if limited:
                await post_capacity(url, model=model, max_num_seqs=seqs)
            for delay in delays:
                nursery.start_soon(client_loop, host, port, request, float(delay), stop_at, results)
            if clients_n > 1 and args.probe_every > 0:
                nursery.start_soon(probe_loop, host, port, model, args.probe_every, stop_at, probe)
            nursery.start_soon(measure_window)
            if scrape_every > 0:
                nursery.start_soon(scrape_until, url, scrape_every, stop_at, scrapes)
    after_total = await get_stats(url)
    stolen = steal_pct(steal_before[0], machine_steal())
    if limited:
        await post_capacity(url, model=model, max_num_seqs=original_seqs)
    wall = time.perf_counter() - measured_from
    m_before, m_after = model_entry(before, model), model_entry(after_total, model)
    events = m_after["pacing_lag_ms"]["events"] - m_before["pacing_lag_ms"]["events"]
    window = model_entry(await get_stats_last(url, events), model)["pacing_lag_ms"]
    lag_total = m_after["pacing_lag_ms"]["total"] - m_before["pacing_lag_ms"]["total"]
    cpu = after_total["process"]["cpu_seconds"] - before["process"]["cpu_seconds"]
    cpu_wall = after_total["process"]["monotonic_seconds"] - before["process"]["monotonic_seconds"]
    ok = [r for r in results if r.start >= measured_from and r.status == 200]
    bad = [r for r in results if r.start >= measured_from and r.status != 200]
    gaps: list[float] = []
    per_write: list[int] = []
    for r in ok:
        per_write.extend(n for _, n in r.writes)
        gaps.extend(b[0] - a[0] for a, b in zip(r.writes, r.writes[1:], strict=False))
    e2e = [r.e2e for r in ok]
    median = statistics.median(e2e) if e2e else float("nan")
    return LevelReport(
        level=level,
        clients=clients_n,
        seqs=seqs,
        requests=len(ok),
        ttft_p50_ms=_p([r.ttft for r in ok], 50),
        e2e_p50_ms=median * 1000,
        roofline_ms=model_fig["e2e"] * 1000,
        error_pct=(median - model_fig["e2e"]) / model_fig["e2e"] * 100,
        probe_ttft_p50_ms=_p(probe, 50),
        probe_model_ms=model_fig["probe_ttft"] * 1000,
        itl_p50_ms=_p(gaps, 50),
        itl_p90_ms=_p(gaps, 90),
        tokens_per_write=float(np.mean(per_write)) if per_write else float("nan"),
        step_ms=model_fig["step"] * 1000,
        tokens_per_s=sum(r.tokens for r in ok) / wall,
        server_cpu_pct=cpu / cpu_wall * 100 if cpu_wall > 0 else float("nan"),
        steal_pct=stolen,
        lag_mean_ms=lag_total / events if events else 0.0,
        lag_p99_ms=window["window_p99"],
        errors=len(bad),
    )


async def scrape_until(url: str, every: float, stop_at: float, latencies: list[float]) -> None:
    """``GET /metrics`` every ``every`` seconds (a Prometheus-like scraper) until
    ``stop_at``."""
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(scrape_loop, url, "/metrics", every, stop, latencies, [])
        await trio.sleep(max(0.0, stop_at - time.perf_counter()))
        stop.set()


async def get_stats_last(url: str, events: int) -> dict[str, Any]:
    """``/control/stats`` with lag percentiles over the last ``events`` engine events."""
    status, answer = await request_json(url, "GET", f"/control/stats?last={max(0, events)}")
    if status != 200:
        raise RuntimeError(f"/control/stats: HTTP {status}")
    return dict(answer)


HEADER = (
    f"{'level':>6} {'reqs':>5} {'TTFT p50':>9} {'E2E p50':>9} {'roofline':>9} {'err %':>6} "
    f"{'probe TTFT':>10} {'model':>7} {'ITL p50':>8} {'ITL p90':>8} {'tok/wr':>6} "
    f"{'step':>6} {'CPU %':>6} {'steal %':>7} {'lag mean':>8} {'lag p99':>8}"
)


def format_row(r: LevelReport) -> str:
    def ms(value: float, width: int, digits: int = 2) -> str:
        return f"{'-':>{width}}" if math.isnan(value) else f"{value:>{width}.{digits}f}"

    return (
        f"{r.level:>6} {r.requests:>5} {ms(r.ttft_p50_ms, 9)} {ms(r.e2e_p50_ms, 9, 1)} "
        f"{ms(r.roofline_ms, 9, 1)} {r.error_pct:>+6.2f} {ms(r.probe_ttft_p50_ms, 10)} "
        f"{ms(r.probe_model_ms, 7)} {ms(r.itl_p50_ms, 8)} {ms(r.itl_p90_ms, 8)} "
        f"{ms(r.tokens_per_write, 6, 1)} {ms(r.step_ms, 6)} {ms(r.server_cpu_pct, 6, 0)} "
        f"{ms(r.steal_pct, 7, 1)} {ms(r.lag_mean_ms, 8, 3)} {ms(r.lag_p99_ms, 8)}"
        + (f"  ({r.errors} errors)" if r.errors else "")
    )


async def main_async(
    args: argparse.Namespace, dep: Deployment, url: str, fresh: bool
) -> list[LevelReport]:
    if fresh:
        print(await first_request(url, args.model, dep, args.max_tokens), flush=True)
    print("times in ms; ITL = gap between successive writes a client receives")
    print(HEADER)
    print("-" * len(HEADER), flush=True)
    rows = []
    for level in args.levels:
        row = await run_level(url, args.model, dep, level, args)
        rows.append(row)
        print(format_row(row), flush=True)
        if args.scrape_every > 0:
            scraped = await run_level(url, args.model, dep, level, args, args.scrape_every)
            rows.append(attrs.evolve(scraped, level=f"{level}+m"))
            shift = (scraped.e2e_p50_ms - row.e2e_p50_ms) / row.e2e_p50_ms * 100
            print(format_row(attrs.evolve(scraped, level=f"{level}+m")), flush=True)
            print(
                f"{'':>6} /metrics every {args.scrape_every * 1000:.0f} ms moved E2E p50 by "
                f"{shift:+.2f} %",
                flush=True,
            )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="benchmark a running server instead of starting one")
    parser.add_argument("--model", default="gpt-oss-20b")
    parser.add_argument("--hardware", default="b200")
    parser.add_argument(
        "--levels",
        type=lambda s: s.split(","),
        default=["1", "24", "64", "256", "24>8"],
        help="comma-separated levels: C clients, or C>S (C clients after a live "
        "max_num_seqs S) (default 1,24,64,256,24>8)",
    )
    parser.add_argument("--duration", type=float, default=12.0, help="measured seconds per level")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument(
        "--probe-every", type=float, default=0.05, help="seconds between probe requests (0: none)"
    )
    parser.add_argument(
        "--scrape-every",
        type=float,
        default=0.0,
        help="also run each level with GET /metrics every S seconds beside it (level 'C+m') "
        "and print the E2E shift (0: no; the scrape benchmark uses 0.1)",
    )
    parser.add_argument(
        "--fresh-servers",
        type=int,
        default=0,
        metavar="N",
        help="instead of the levels: time the first request after start of N servers",
    )
    parser.add_argument(
        "--idle", type=float, default=0.5, help="seconds a fresh server idles before it"
    )
    parser.add_argument("-o", "--output", help="write the rows as JSON here")
    args = parser.parse_args()
    if args.fresh_servers < 0 or args.idle < 0:
        parser.error("--fresh-servers and --idle must not be negative")
    if not args.duration > 0 or args.max_tokens < 1 or args.probe_every < 0:
        parser.error("--duration and --max-tokens must be positive, --probe-every not negative")
    for level in args.levels:
        if not re.fullmatch(r"[1-9][0-9]*(>[1-9][0-9]*)?", level):
            parser.error(f"--levels: {level!r} is neither C nor C>S (positive integers)")
    try:
        dep = load_deployment(shipped_dir("configs") / f"{args.model}.toml", args.hardware)
    except ConfigError as exc:
        print(f"bench_serve: {exc}", file=sys.stderr)
        return 2
    if args.fresh_servers:
        if args.url is not None:
            parser.error("--fresh-servers starts its own servers: it takes no --url")
        try:
            firsts = first_requests(args, dep)
        except (OSError, RuntimeError) as exc:
            print(f"bench_serve: {exc}", file=sys.stderr)
            return 1
        if args.output:
            Path(args.output).write_text(json.dumps(firsts, indent=2))
        return 0
    server = None
    url = args.url
    if url is None:
        clients = max(int(level.partition(">")[0]) for level in args.levels)
        server = ServerProcess(
            [
                "--config",
                str(shipped_dir("configs") / f"{args.model}.toml"),
                "--hardware",
                args.hardware,
                "--max-num-seqs",
                str(max(256, clients)),
            ]
        )
        try:
            server.__enter__()
        except RuntimeError as exc:
            print(f"bench_serve: {exc}", file=sys.stderr)
            return 1
        url = server.url
    print(
        f"bench_serve: {args.model} on {args.hardware}, {PROMPT}-token prompts, "
        f"{args.max_tokens}-token streamed responses, {args.duration:g} s measured per level, "
        f"server {url}",
        flush=True,
    )
    try:
        rows = trio.run(main_async, args, dep, url, server is not None)
    finally:
        if server is not None:
            server.stop()
    if args.output:
        Path(args.output).write_text(json.dumps([attrs.asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
