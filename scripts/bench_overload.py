"""Benchmark the cost of refusing work: 529s fired while 24 streams run.

Starts ``inference-lab serve`` on the shipped models (b200) unless ``--url`` is given, then
retunes it through ``POST /control/capacity``: gpt-oss-20b gets ``max_num_seqs 24`` and 24
closed-loop clients streaming 200-token responses (50-token prompts) — all admitted, none
waiting; Llama-3-70B gets ``max_num_seqs 1, max_waiting 1`` and two very long
non-streaming requests, one running and one waiting, so its queue sits at its bound for
the whole run. A second client, in a process of its own (so that the stream client's
own event loop does not delay the refusals it times), fires requests at that full queue
at a fixed rate (0, 100, 200, 500 per second by default), **each on a new connection**
(connect, send, read the answer, close) as a refused client that backs off and comes
back does; every one is refused with 529 by the same admission path any model uses, in
the same server process and on the same core as the 24 streams. Per rate it prints:

- refusals/s achieved, how many answers were not 529 (or never came), and the 529
  latency p50 / p99 (connect -> complete response), and the p99 of the connect alone
  (the kernel's handshake and accept queue, before the server's process is involved);
- the streams' median E2E and its shift against the rate-0 baseline;
- the server's CPU and pacing lag over the level, and the CPU each refusal cost (the
  CPU above the rate-0 baseline over the refusals answered);
- the share of this machine's CPU time the hypervisor took for other work meanwhile
  (``steal`` in ``/proc/stat``; "-" where there is none): above a few per cent the
  machine was slowed from outside while the level ran.

    python scripts/bench_overload.py
    python scripts/bench_overload.py --rates 0,1000 --duration 15

Only 127.0.0.1 (or the given URL) is contacted; every level is bounded in time and count.
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
from typing import Any

import attrs
import numpy as np
import trio
from benchkit import (
    Result,
    ServerProcess,
    client_loop,
    completion_request,
    get_capacity,
    get_stats,
    machine_steal,
    model_entry,
    post_capacity,
    read_response,
    request_json,
    steal_pct,
)

from inference_lab.core.config import load_deployment
from inference_lab.errors import ConfigError
from inference_lab.resources import shipped_dir

STREAMS = 24
#: The model whose queue is held full: its one running request decodes in 17.5 ms steps on
#: b200, so keeping it busy costs the server next to nothing (a model with 2 ms steps would
#: spend a tenth of the core on its own pacing, beside the streams being measured).
PINNED = "Llama-3-70B"
PINNED_TOKENS = 8000  # ~140 s of decoding: longer than the whole benchmark
#: Refusals in flight at once, at most (a ticket that finds them all busy is dropped and
#: counted as not answered).
MAX_IN_FLIGHT = 256
#: Seconds a refusal may take before it counts as not answered.
REFUSAL_TIMEOUT = 10.0


@attrs.define
class Refusal:
    start: float
    latency: float
    status: int  # 0: no answer (refused connection, reset, timeout)
    connect: float = math.nan  # seconds until the connection was established


def _refused_request(host: str) -> bytes:
    body = json.dumps(
        {"model": PINNED, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    ).encode()
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def refuse_once(host: str, port: int, request: bytes, out: list[Refusal]) -> None:
    """One refused client: a new connection, one request, its answer, close."""
    start = time.perf_counter()
    status = 0
    connect = math.nan
    with trio.move_on_after(REFUSAL_TIMEOUT):
        try:
            stream = await trio.open_tcp_stream(host, port)
            connect = time.perf_counter() - start
            try:
                await stream.send_all(request)
                status, _ = await read_response(stream, bytearray())
            finally:
                await stream.aclose()
        except (OSError, ConnectionError, trio.BrokenResourceError):
            status = 0
    out.append(Refusal(start, time.perf_counter() - start, status, connect))


async def fire(
    host: str, port: int, rate: float, start_at: float, stop_at: float, out: list[Refusal]
) -> int:
    """Start a refused client every ``1/rate`` seconds from ``start_at`` (a fixed
    schedule: late ones start at once) until ``stop_at`` (``time.perf_counter`` values,
    the system's monotonic clock); returns how many tickets found MAX_IN_FLIGHT busy."""
    request = _refused_request(host)
    limiter = trio.CapacityLimiter(MAX_IN_FLIGHT)
    dropped = 0

    async def one() -> None:
        async with limiter:
            await refuse_once(host, port, request, out)

    async with trio.open_nursery() as nursery:
        next_at = start_at
        while next_at < stop_at:
            await trio.sleep(max(0.0, next_at - time.perf_counter()))
            if limiter.available_tokens:
                nursery.start_soon(one)
            else:
                dropped += 1
            next_at += 1.0 / rate
    return dropped


async def fire_elsewhere(
    host: str, port: int, rate: float, start_at: float, stop_at: float, out: list[Refusal]
) -> int:
    """:func:`fire` in a child process (this script with ``--fire``), its refusals added
    to ``out``; returns its dropped count."""
    plan = json.dumps([host, port, rate, start_at, stop_at])
    done = await trio.run_process(
        [sys.executable, __file__, "--fire", plan], capture_stdout=True, check=True
    )
    report = json.loads(done.stdout)
    out.extend(Refusal(*r) for r in report["refusals"])
    return int(report["dropped"])


def fire_main(plan: str) -> int:
    """The child of :func:`fire_elsewhere`: fire as planned, print the refusals as JSON."""
    host, port, rate, start_at, stop_at = json.loads(plan)
    refusals: list[Refusal] = []
    dropped = trio.run(fire, host, int(port), float(rate), start_at, stop_at, refusals)
    print(json.dumps({"dropped": dropped, "refusals": [attrs.astuple(r) for r in refusals]}))
    return 0


@attrs.frozen
class Row:
    rate: float
    refusals_per_s: float
    not_refused: int
    refusal_p50_ms: float
    refusal_p99_ms: float
    connect_p99_ms: float
    streams: int
    e2e_p50_ms: float
    server_cpu_pct: float
    steal_pct: float
    lag_mean_ms: float
    lag_p99_ms: float


async def run_level(url: str, model: str, rate: float, duration: float) -> Row:
    parsed = urllib.parse.urlsplit(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    stream_request = completion_request(host, model, 200)
    results: list[Result] = []
    refusals: list[Refusal] = []
    warmup = 1.5  # the streams fill the batch and settle
    start = time.perf_counter()
    stop_at = start + warmup + duration
    delays = np.random.default_rng(1).uniform(0.0, 0.3, STREAMS)
    before: dict[str, Any] = {}
    steal_before: list[tuple[int, int] | None] = [None]
    dropped = [0]

    async def measured() -> None:
        if rate > 0:
            dropped[0] = await fire_elsewhere(host, port, rate, start + warmup, stop_at, refusals)

    async def baseline() -> None:
        await trio.sleep(warmup)
        steal_before[0] = machine_steal()
        before.update(await get_stats(url))

    with trio.fail_after(warmup + duration + 60):
        async with trio.open_nursery() as nursery:
            for delay in delays:
                nursery.start_soon(
                    client_loop, host, port, stream_request, float(delay), stop_at, results
                )
            nursery.start_soon(baseline)
            nursery.start_soon(measured)
    after = await get_stats(url)
    stolen = steal_pct(steal_before[0], machine_steal())
    m_before, m_after = model_entry(before, model), model_entry(after, model)
    events = m_after["pacing_lag_ms"]["events"] - m_before["pacing_lag_ms"]["events"]
    status, window = await request_json(url, "GET", f"/control/stats?last={max(0, events)}")
    lag_p99 = model_entry(window, model)["pacing_lag_ms"]["window_p99"] if status == 200 else 0.0
    lag_total = m_after["pacing_lag_ms"]["total"] - m_before["pacing_lag_ms"]["total"]
    cpu = after["process"]["cpu_seconds"] - before["process"]["cpu_seconds"]
    cpu_wall = after["process"]["monotonic_seconds"] - before["process"]["monotonic_seconds"]
    measured_from = start + warmup
    e2e = [r.e2e for r in results if r.start >= measured_from and r.status == 200]
    refused = [r.latency for r in refusals if r.status == 529]
    connects = [r.connect for r in refusals if r.status == 529]
    return Row(
        rate=rate,
        refusals_per_s=len(refused) / duration if rate else 0.0,
        not_refused=sum(1 for r in refusals if r.status != 529) + dropped[0],
        refusal_p50_ms=float(np.percentile(refused, 50)) * 1000 if refused else math.nan,
        refusal_p99_ms=float(np.percentile(refused, 99)) * 1000 if refused else math.nan,
        connect_p99_ms=float(np.percentile(connects, 99)) * 1000 if connects else math.nan,
        streams=len(e2e),
        e2e_p50_ms=statistics.median(e2e) * 1000 if e2e else math.nan,
        server_cpu_pct=cpu / cpu_wall * 100 if cpu_wall > 0 else math.nan,
        steal_pct=stolen,
        lag_mean_ms=lag_total / events if events else 0.0,
        lag_p99_ms=lag_p99,
    )


HEADER = (
    f"{'rate':>6} {'529/s':>7} {'not 529':>8} {'529 p50':>8} {'529 p99':>8} {'conn p99':>8} "
    f"{'streams':>7} "
    f"{'E2E p50':>9} {'shift':>7} {'CPU %':>6} {'CPU/529':>8} {'steal %':>7} {'lag mean':>9} "
    f"{'lag p99':>8}"
)


def _ms(value: float) -> str:
    """A latency column: '-' where there was nothing to measure (the rate-0 baseline)."""
    return f"{'-':>8}" if math.isnan(value) else f"{value:>6.2f}ms"


def _pct(value: float) -> str:
    """A share in per cent: '-' where it is unknown."""
    return f"{'-':>7}" if math.isnan(value) else f"{value:>7.1f}"


def format_row(row: Row, baseline: Row) -> str:
    """A row; the shift and the CPU per refusal are against the rate-0 ``baseline``."""
    base = baseline.e2e_p50_ms
    shift = (row.e2e_p50_ms - base) / base * 100 if base else 0.0
    extra = (row.server_cpu_pct - baseline.server_cpu_pct) / 100  # cores
    per_refusal = extra / row.refusals_per_s * 1000 if row.refusals_per_s else math.nan
    return (
        f"{row.rate:>6.0f} {row.refusals_per_s:>7.1f} {row.not_refused:>8} "
        f"{_ms(row.refusal_p50_ms)} {_ms(row.refusal_p99_ms)} {_ms(row.connect_p99_ms)} "
        f"{row.streams:>7} "
        f"{row.e2e_p50_ms:>7.1f}ms {shift:>+6.2f}% {row.server_cpu_pct:>6.0f} "
        f"{_ms(per_refusal)} {_pct(row.steal_pct)} {row.lag_mean_ms:>7.3f}ms "
        f"{row.lag_p99_ms:>6.2f}ms"
    )


async def hold_queue_full(
    host: str, port: int, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Two long requests on the pinned model: one runs, one waits (max_waiting 1). They
    are aborted when this task is cancelled (their connections close)."""
    body = json.dumps(
        {
            "model": PINNED,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": PINNED_TOKENS,
            "ignore_eos": True,  # runs to max_tokens
        }
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
    await post_capacity(url, model=args.model, max_num_seqs=STREAMS)
    await post_capacity(url, model=PINNED, max_num_seqs=1, max_waiting=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(hold_queue_full, host, port)
        pinned = model_entry(await get_capacity(url), PINNED)
        assert (pinned["running"], pinned["waiting"]) == (1, 1), pinned
        print(HEADER)
        print("-" * len(HEADER), flush=True)
        rows: list[Row] = []
        for rate in args.rates:
            row = await run_level(url, args.model, rate, args.duration)
            rows.append(row)
            print(format_row(row, rows[0]), flush=True)
        nursery.cancel_scope.cancel()
    return rows


def _rates(text: str) -> list[float]:
    """``--rates``: comma-separated refusal rates per second, each finite and >= 0."""
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not all(math.isfinite(rate) and rate >= 0 for rate in rates):
        raise argparse.ArgumentTypeError(f"each rate must be a number >= 0: {text!r}")
    return rates


def main() -> int:
    if sys.argv[1:2] == ["--fire"]:
        return fire_main(sys.argv[2])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--url", help=f"use a running server (serving {PINNED}); its capacity is retuned"
    )
    parser.add_argument("--model", default="gpt-oss-20b")
    parser.add_argument(
        "--rates",
        type=_rates,
        default=[0.0, 100.0, 200.0, 500.0],
        help="refusal rates per second; the first is the baseline (default 0,100,200,500)",
    )
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per rate")
    parser.add_argument("-o", "--output", help="write the rows as JSON here")
    args = parser.parse_args()
    if not args.duration > 0:
        parser.error("--duration must be positive")
    if args.url is None:  # the server started here serves the shipped configs
        try:
            load_deployment(shipped_dir("configs") / f"{args.model}.toml", "b200")
        except ConfigError as exc:
            print(f"bench_overload: --model: {exc}", file=sys.stderr)
            return 2
    server = None
    url = args.url
    if url is None:
        server = ServerProcess(["--hardware", "b200"])
        try:
            server.__enter__()
        except RuntimeError as exc:
            print(f"bench_overload: {exc}", file=sys.stderr)
            return 1
        url = server.url
    print(
        f"bench_overload: {STREAMS} closed-loop streams on {args.model}, 529s fired at the full "
        f"queue of {PINNED} at {args.rates} per s (a new connection each), "
        f"{args.duration:g} s each, server {url}",
        flush=True,
    )
    try:
        rows = trio.run(main_async, args, url)
    except (OSError, RuntimeError) as exc:  # e.g. a --url server that lacks a model
        print(f"bench_overload: {exc}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
    if args.output:
        Path(args.output).write_text(json.dumps([attrs.asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
