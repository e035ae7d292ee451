"""Benchmark the cost of refusing work: 529s fired while 24 streams run.

Starts ``inference-lab serve`` on every shipped model (b200) unless ``--url`` is given, then
retunes it through ``POST /control/capacity``: gpt-oss-20b gets ``max_num_seqs 24`` and 24
closed-loop clients streaming 200-token responses (50-token prompts) — all admitted, none
waiting; Llama-3.1-8B-Instruct gets ``max_num_seqs 1, max_waiting 1`` and two very long
non-streaming requests, one running and one waiting, so its queue sits at its bound for
the whole run. A second client fires requests at that full queue at a fixed rate (0, 100,
200, 500 per second by default) over 32 keep-alive connections; every one is refused
with 529 by the same admission path any model uses, in the same process and on the same
core as the 24 streams. Per rate it prints:

- refusals/s achieved and the 529 latency p50 / p99 (send -> complete response),
- the streams' median E2E and its shift against the rate-0 baseline,
- the server's pacing lag over the level.

    python scripts/bench_overload.py
    python scripts/bench_overload.py --rates 0,1000 --duration 15

Only 127.0.0.1 (or the given URL) is contacted; every level is bounded in time.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import urllib.parse
from pathlib import Path

import attrs
import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serve import PROMPT_BYTES, Result, _entry, _http_get, client_loop, start_server  # noqa: E402

STREAMS = 24
PINNED = "Llama-3.1-8B-Instruct"  # the model whose queue is held full


@attrs.define
class Refusal:
    start: float
    latency: float
    status: int


async def _read_response(stream: trio.SocketStream) -> int:
    """Read one content-length response; return its status."""
    buf = bytearray()
    while b"\r\n\r\n" not in buf:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise ConnectionError("server closed the connection")
        buf += chunk
    head, _, body = bytes(buf).partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise ConnectionError("server closed the connection")
        body += chunk
    if b"\r\nconnection: close" in head.lower():
        raise ConnectionResetError("close requested")
    return int(head[9:12])


async def refuser(
    host: str,
    port: int,
    request: bytes,
    tickets: trio.MemoryReceiveChannel[float],
    out: list[Refusal],
) -> None:
    """One keep-alive connection sending a request per ticket."""
    stream = await trio.open_tcp_stream(host, port)
    try:
        async for _ in tickets:
            start = time.perf_counter()
            await stream.send_all(request)
            try:
                status = await _read_response(stream)
            except ConnectionResetError:
                status = 529
                await stream.aclose()
                stream = await trio.open_tcp_stream(host, port)
            out.append(Refusal(start, time.perf_counter() - start, status))
    finally:
        await stream.aclose()


async def fire(
    host: str, port: int, model: str, rate: float, stop_at: float, out: list[Refusal]
) -> None:
    """Hand out tickets at ``rate`` per second (a fixed schedule: late tickets are sent at
    once) to a few keep-alive connections."""
    body = json.dumps(
        {"model": PINNED, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    ).encode()
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body
    send, receive = trio.open_memory_channel[float](1000)
    async with trio.open_nursery() as nursery:
        for _ in range(32):
            nursery.start_soon(refuser, host, port, request, receive.clone(), out)
        receive.close()
        async with send:
            next_at = time.perf_counter()
            while next_at < stop_at:
                await trio.sleep_until(
                    trio.current_time() + max(0.0, next_at - time.perf_counter())
                )
                try:
                    send.send_nowait(next_at)
                except trio.WouldBlock:
                    pass  # connections saturated: the rate is not reached (reported)
                next_at += 1.0 / rate


@attrs.frozen
class Row:
    rate: float
    refusals_per_s: float
    admitted_extra: int
    refusal_p50_ms: float
    refusal_p99_ms: float
    streams: int
    e2e_p50_ms: float
    lag_mean_ms: float
    lag_p99_ms: float


async def run_level(host: str, port: int, model: str, rate: float, duration: float) -> Row:
    body = json.dumps(
        {"model": model, "prompt": "x" * PROMPT_BYTES, "max_tokens": 200, "stream": True}
    ).encode()
    stream_request = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body
    before = _entry(await _http_get(host, port, "/control/stats"), model)
    results: list[Result] = []
    refusals: list[Refusal] = []
    start = time.perf_counter()
    stop_at = start + duration
    delays = np.random.default_rng(1).uniform(0.0, 0.3, STREAMS)
    with trio.fail_after(duration + 60):
        async with trio.open_nursery() as nursery:
            for delay in delays:
                nursery.start_soon(
                    client_loop, host, port, stream_request, float(delay), stop_at, results
                )
            if rate > 0:
                # refusals start once the streams have filled the batch
                await trio.sleep(1.0)
                nursery.start_soon(fire, host, port, model, rate, stop_at, refusals)
    wall = time.perf_counter() - start
    events = _entry(await _http_get(host, port, "/control/stats"), model)["pacing_lag_ms"]["events"]
    after = _entry(
        await _http_get(
            host, port, f"/control/stats?last={events - before['pacing_lag_ms']['events']}"
        ),
        model,
    )
    lag_b, lag_a = before["pacing_lag_ms"], after["pacing_lag_ms"]
    n_events = lag_a["events"] - lag_b["events"]
    warm = sorted(results, key=lambda r: r.start)[STREAMS:]
    e2e = [r.e2e for r in warm if r.status == 200]
    refused = [r.latency for r in refusals if r.status == 529]
    window = max(1e-9, wall - 1.0)
    return Row(
        rate=rate,
        refusals_per_s=len(refused) / window if rate else 0.0,
        admitted_extra=sum(1 for r in refusals if r.status == 200),
        refusal_p50_ms=float(np.percentile(refused, 50)) * 1000 if refused else float("nan"),
        refusal_p99_ms=float(np.percentile(refused, 99)) * 1000 if refused else float("nan"),
        streams=len(e2e),
        e2e_p50_ms=statistics.median(e2e) * 1000 if e2e else float("nan"),
        lag_mean_ms=(lag_a["total"] - lag_b["total"]) / n_events if n_events else 0.0,
        lag_p99_ms=lag_a["window_p99"],
    )


HEADER = (
    f"{'rate':>6} {'529/s':>7} {'not 529':>8} {'529 p50':>8} {'529 p99':>8} {'streams':>7} "
    f"{'E2E p50':>9} {'shift':>7} {'lag mean':>9} {'lag p99':>8}"
)


def _ms(value: float) -> str:
    """A latency column: '-' where there was nothing to measure (the rate-0 baseline)."""
    return f"{'-':>8}" if math.isnan(value) else f"{value:>6.2f}ms"


def format_row(row: Row, baseline: float) -> str:
    shift = (row.e2e_p50_ms - baseline) / baseline * 100 if baseline else 0.0
    return (
        f"{row.rate:>6.0f} {row.refusals_per_s:>7.1f} {row.admitted_extra:>8} "
        f"{_ms(row.refusal_p50_ms)} {_ms(row.refusal_p99_ms)} {row.streams:>7} "
        f"{row.e2e_p50_ms:>7.1f}ms {shift:>+6.2f}% {row.lag_mean_ms:>7.3f}ms "
        f"{row.lag_p99_ms:>6.2f}ms"
    )


async def _post(host: str, port: int, path: str, body: object) -> tuple[int, bytes]:
    payload = json.dumps(body).encode()
    stream = await trio.open_tcp_stream(host, port)
    request = (
        f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n"
    ).encode() + payload
    await stream.send_all(request)
    data = bytearray()
    while chunk := await stream.receive_some(65536):
        data += chunk
    await stream.aclose()
    head, _, rest = bytes(data).partition(b"\r\n\r\n")
    return int(head[9:12]), rest


async def hold_queue_full(
    host: str, port: int, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Two long requests on the pinned model: one runs, one waits (max_waiting 1). They
    are aborted when this task is cancelled (their connections close)."""
    body = json.dumps(
        {"model": PINNED, "messages": [{"role": "user", "content": "x"}], "max_tokens": 100_000}
    ).encode()
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body
    streams = [await trio.open_tcp_stream(host, port) for _ in range(2)]
    try:
        for stream in streams:
            await stream.send_all(request)
            await trio.sleep(0.2)
        task_status.started()
        await trio.sleep_forever()
    finally:
        for stream in streams:
            await stream.aclose()


async def main_async(args: argparse.Namespace, url: str) -> list[Row]:
    parsed = urllib.parse.urlsplit(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    await _post(host, port, "/control/capacity", {"model": args.model, "max_num_seqs": 24})
    await _post(
        host, port, "/control/capacity", {"model": PINNED, "max_num_seqs": 1, "max_waiting": 1}
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(hold_queue_full, host, port)
        capacity = await _http_get(host, port, "/control/capacity")
        pinned = next(entry for entry in capacity if entry["model"] == PINNED)
        assert (pinned["running"], pinned["waiting"]) == (1, 1), pinned
        rows = await _run_levels(args, host, port)
        nursery.cancel_scope.cancel()
    return rows


async def _run_levels(args: argparse.Namespace, host: str, port: int) -> list[Row]:
    print(HEADER)
    print("-" * len(HEADER), flush=True)
    rows: list[Row] = []
    baseline = 0.0
    for rate in args.rates:
        row = await run_level(host, port, args.model, rate, args.duration)
        if not rows:
            baseline = row.e2e_p50_ms
        rows.append(row)
        print(format_row(row, baseline), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--url", help=f"use a running server (serving {PINNED}); its capacity is retuned"
    )
    parser.add_argument("--model", default="gpt-oss-20b")
    parser.add_argument(
        "--rates",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[0.0, 100.0, 200.0, 500.0],
        help="refusal rates per second; the first is the baseline (default 0,100,200,500)",
    )
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per rate")
    parser.add_argument("-o", "--output", help="write the rows as JSON here")
    args = parser.parse_args()
    server = None
    url = args.url
    if url is None:
        server = start_server(["--config", "configs/", "--hardware", "b200"])
        url = server.url
    print(
        f"bench_overload: {STREAMS} closed-loop streams on {args.model}, 529s fired at the full "
        f"queue of {PINNED} at {args.rates} per s, {args.duration:g} s each, server {url}",
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
