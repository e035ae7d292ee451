"""Benchmark serve mode against the roofline: closed-loop streams through real HTTP.

Starts ``inference-lab serve`` (gpt-oss-20b on b200 by default) in a subprocess — its own
process, so on a 2-core machine the server and this client each get a core — unless
``--url`` points at a running server. For each concurrency level C it runs C closed-loop
clients, each streaming ``/v1/completions`` requests of a 200-byte prompt (exactly 50
prompt tokens) and ``max_tokens`` 200 back to back on one keep-alive connection, and
prints per level:

- the measured median end-to-end latency (send -> last byte) after a warm-up round,
- the roofline prediction for batch C (all C requests in lock-step: one prefill step of
  C x 50 tokens, then 199 decode steps of C requests at growing context),
- the engine's own closed-loop prediction (the same engine, simulated offline with
  zero client turnaround),
- the error of the measurement against the roofline prediction,
- tokens/s delivered to the clients, and the server's pacing lag over the level.

The client is deliberately raw (trio sockets, no HTTP parser): it only needs the status
line, the time of the first token and the end of the chunked body, so it stays cheap next
to the server. Only 127.0.0.1 (or the given URL) is contacted; every level is bounded in
time.

    python scripts/bench_serve.py                       # 1, 8, 24, 64, 256 clients
    python scripts/bench_serve.py --levels 24 --duration 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import trio

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _experiment_server import ServerProcess  # noqa: E402

from inference_lab.config import load_deployment  # noqa: E402
from inference_lab.engine import Engine, RequestSpec  # noqa: E402
from inference_lab.roofline import Roofline  # noqa: E402

PROMPT_BYTES = 200  # ceil(200 / 4) = 50 prompt tokens on /v1/completions
_TERMINATOR = b"0\r\n\r\n"


# ---------------------------------------------------------------------------------------
# predictions


def roofline_lockstep_e2e(dep: Any, batch: int, prompt: int, output: int) -> float:
    """E2E of ``batch`` identical requests moving in lock-step: one prefill step, then
    ``output - 1`` decode steps of the whole batch."""
    roof = Roofline(dep)
    ones = np.ones(batch, dtype=np.int64)
    total = roof.step_time(ones * prompt, ones * 0)
    for k in range(1, output):
        total += roof.step_time(ones, ones * (prompt + k - 1))
    return float(total)


def engine_closed_loop_e2e(
    dep: Any, users: int, prompt: int, output: int, rounds: int, jitter: float
) -> float:
    """Median E2E of an ideal closed loop on the engine itself: user i first arrives at
    U(0, jitter), then resubmits the moment its previous request finishes (no client
    turnaround)."""
    engine = Engine(dep)
    rng = np.random.default_rng(0)
    starts = sorted(rng.uniform(0.0, jitter, users)) if jitter > 0 else [0.0] * users
    e2e: list[float] = []
    done = 0
    for at in starts:
        engine.submit(RequestSpec(prompt, output, arrival_time=float(at)))
    while done < users * rounds:
        events = engine.step()
        for fin in events.finished:
            done += 1
            if done > users:  # skip the first, synchronised round
                e2e.append(fin.finish_time - fin.arrival_time)
            engine.submit(RequestSpec(prompt, output, arrival_time=fin.finish_time))
    return float(np.median(e2e))


# ---------------------------------------------------------------------------------------
# the server


def start_server(args: list[str]) -> ServerProcess:
    """``inference-lab serve`` with ``args`` in a subprocess, healthy; ``.stop()`` ends it."""
    return ServerProcess(args).__enter__()


# ---------------------------------------------------------------------------------------
# the client


@attrs.define
class Result:
    start: float
    ttft: float
    e2e: float
    tokens: int
    status: int


def _entry(stats: Any, model: str) -> dict[str, Any]:
    """The /control/stats entry of ``model``."""
    models = stats["models"] if isinstance(stats, dict) else stats
    return next(entry for entry in models if entry["model"] == model)


async def _http_get(host: str, port: int, path: str) -> Any:
    stream = await trio.open_tcp_stream(host, port)
    request = f"GET {path} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n"
    await stream.send_all(request.encode())
    data = bytearray()
    while chunk := await stream.receive_some(65536):
        data += chunk
    await stream.aclose()
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        out = bytearray()
        while body:
            size_line, _, rest = body.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            out += rest[:size]
            body = rest[size + 2 :]
        body = bytes(out)
    return json.loads(body)


async def client_loop(
    host: str,
    port: int,
    request: bytes,
    delay: float,
    stop_at: float,
    results: list[Result],
) -> None:
    """One closed-loop user on one keep-alive connection: wait ``delay``, then send, read
    to the end of the chunked body, send again."""
    stream = await trio.open_tcp_stream(host, port)
    await trio.sleep(delay)
    try:
        while time.perf_counter() < stop_at:
            start = time.perf_counter()
            await stream.send_all(request)
            buf = bytearray()
            ttft = 0.0
            done_at = 0.0
            while True:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    raise ConnectionError("server closed the connection")
                buf += chunk
                now = time.perf_counter()
                if not ttft and b'"text":"the ' in chunk:
                    ttft = now - start
                if not done_at and b"[DONE]" in chunk:
                    done_at = now  # the last token arrived with [DONE]
                if buf.endswith(_TERMINATOR) and b"[DONE]" in buf[-200:]:
                    break
                if buf.startswith(b"HTTP/1.1 5") and buf.endswith(b"}"):
                    break
            end = done_at or time.perf_counter()
            status = int(buf[9:12])
            tokens = buf.count(b'"text":"') - 1 if status == 200 else 0
            results.append(Result(start, ttft, end - start, tokens, status))
            if b"\r\nconnection: close\r\n" in buf[: buf.find(b"\r\n\r\n") + 2].lower():
                # hypercorn closes a keep-alive connection after keep_alive_max_requests
                await stream.aclose()
                stream = await trio.open_tcp_stream(host, port)
    finally:
        await stream.aclose()


@attrs.frozen
class LevelReport:
    clients: int
    requests: int
    median_e2e_ms: float
    p90_e2e_ms: float
    median_ttft_ms: float
    server_e2e_ms: float
    roofline_ms: float
    engine_ms: float
    error_pct: float
    tokens_per_s: float
    lag_mean_ms: float
    lag_p99_ms: float
    lag_max_ms: float
    errors: int


async def run_level(
    host: str,
    port: int,
    model: str,
    clients: int,
    duration: float,
    max_tokens: int,
    dep: Any,
    jitter_rounds: float,
) -> LevelReport:
    body = json.dumps(
        {
            "model": model,
            "prompt": "x" * PROMPT_BYTES,
            "max_tokens": max_tokens,
            "stream": True,
        }
    ).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body
    prompt = PROMPT_BYTES // 4
    roof = roofline_lockstep_e2e(dep, clients, prompt, max_tokens)
    jitter = roof * jitter_rounds
    delays = (
        np.random.default_rng(1).uniform(0.0, jitter, clients) if jitter > 0 else [0.0] * clients
    )
    before = _entry(await _http_get(host, port, "/control/stats"), model)
    results: list[Result] = []
    start = time.perf_counter()
    stop_at = start + duration
    with trio.fail_after(duration + 120):
        async with trio.open_nursery() as nursery:
            for delay in delays:
                nursery.start_soon(client_loop, host, port, request, float(delay), stop_at, results)
    wall = time.perf_counter() - start
    after_events = _entry(await _http_get(host, port, "/control/stats"), model)["pacing_lag_ms"][
        "events"
    ]
    new_events = after_events - before["pacing_lag_ms"]["events"]
    new_finished = (
        _entry(await _http_get(host, port, "/control/stats"), model)["finished"]
        - before["finished"]
    )
    # the last 2/3 of the level's completions: past the warm-up round
    after = _entry(
        await _http_get(
            host, port, f"/control/stats?last={new_events}&finished={new_finished * 2 // 3}"
        ),
        model,
    )
    lag_before, lag_after = before["pacing_lag_ms"], after["pacing_lag_ms"]
    # warm-up: each client's first request (the closed loop's ramp) is dropped
    warm = sorted(results, key=lambda r: r.start)[clients:]
    ok = [r for r in warm if r.status == 200]
    e2e = [r.e2e for r in ok]
    engine = engine_closed_loop_e2e(dep, clients, prompt, max_tokens, rounds=8, jitter=jitter)
    median = statistics.median(e2e) if e2e else float("nan")
    delta_events = lag_after["events"] - lag_before["events"]
    lag_mean = (lag_after["total"] - lag_before["total"]) / delta_events if delta_events else 0.0
    return LevelReport(
        clients=clients,
        requests=len(ok),
        median_e2e_ms=median * 1000,
        p90_e2e_ms=float(np.percentile(e2e, 90)) * 1000 if e2e else float("nan"),
        median_ttft_ms=statistics.median(r.ttft for r in ok) * 1000 if ok else float("nan"),
        server_e2e_ms=after["sim_e2e_ms"]["p50"],
        roofline_ms=roof * 1000,
        engine_ms=engine * 1000,
        error_pct=(median - roof) / roof * 100,
        tokens_per_s=sum(r.tokens for r in results) / wall,
        lag_mean_ms=lag_mean,
        lag_p99_ms=lag_after["window_p99"],
        lag_max_ms=lag_after["window_max"],
        errors=len(warm) - len(ok),
    )


HEADER = (
    f"{'clients':>7} {'reqs':>5} {'E2E p50':>9} {'roofline':>9} {'err %':>6} "
    f"{'engine':>9} {'sim E2E':>9} {'TTFT p50':>9} {'tok/s':>8} {'lag mean':>9} {'lag p99':>8} "
    f"{'lag max':>8}"
)


def format_row(r: LevelReport) -> str:
    return (
        f"{r.clients:>7} {r.requests:>5} {r.median_e2e_ms:>7.1f}ms {r.roofline_ms:>7.1f}ms "
        f"{r.error_pct:>+6.2f} {r.engine_ms:>7.1f}ms {r.server_e2e_ms:>7.1f}ms "
        f"{r.median_ttft_ms:>7.2f}ms "
        f"{r.tokens_per_s:>8.0f} {r.lag_mean_ms:>7.3f}ms {r.lag_p99_ms:>6.2f}ms "
        f"{r.lag_max_ms:>6.1f}ms"
    )


async def main_async(args: argparse.Namespace, url: str) -> list[LevelReport]:
    parsed = urllib.parse.urlsplit(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    dep = load_deployment(ROOT / "configs" / f"{args.model}.toml", args.hardware)
    print(HEADER)
    print("-" * len(HEADER), flush=True)
    rows = []
    for clients in args.levels:
        row = await run_level(
            host, port, args.model, clients, args.duration, args.max_tokens, dep, args.jitter
        )
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="benchmark a running server instead of starting one")
    parser.add_argument("--model", default="gpt-oss-20b")
    parser.add_argument("--hardware", default="b200")
    parser.add_argument(
        "--levels",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 8, 24, 64, 256],
        help="comma-separated concurrency levels (default 1,8,24,64,256)",
    )
    parser.add_argument("--duration", type=float, default=12.0, help="seconds per level")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument(
        "--jitter",
        type=float,
        default=1.0,
        help="spread the clients' first requests over U(0, J x predicted E2E) so the closed "
        "loop does not run in lock-step (0 = all start at once; default 1)",
    )
    parser.add_argument("-o", "--output", help="write the rows as JSON here")
    args = parser.parse_args()
    server = None
    url = args.url
    if url is None:
        server = start_server(
            [
                "--config",
                f"configs/{args.model}.toml",
                "--hardware",
                args.hardware,
                "--max-num-seqs",
                str(max(256, max(args.levels))),
            ]
        )
        url = server.url
    print(
        f"bench_serve: {args.model} on {args.hardware}, {PROMPT_BYTES // 4}-token prompts, "
        f"{args.max_tokens}-token streamed responses, {args.duration:g} s per level, "
        f"server {url}",
        flush=True,
    )
    try:
        rows = trio.run(main_async, args, url)
    finally:
        if server is not None:
            server.stop()
    if args.output:
        Path(args.output).write_text(json.dumps([attrs.asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
