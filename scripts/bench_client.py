"""How fast can the load client read streamed tokens? (benchmark, not a timed test)

    python scripts/bench_client.py [--streams 64] [--concurrency 16] [--frames 2000]

Starts a minimal fake server (raw trio + h11) in a separate process on 127.0.0.1:0. It
answers every chat completion with ``--frames`` token frames in the server's exact wire
format (``inference_lab.api.encoding``) — one HTTP chunk per frame, as a real ASGI server
sends them — as fast as the socket takes them (the body is framed once and cached, so the server costs next to
nothing). Then this process runs the real load generator (``inference_lab.client.load``,
closed loop) against it and prints the tokens parsed per second and the client's CPU time
per token (``time.process_time`` of this process only). The goal is >= 20,000 tokens/s on
one core: the client must never be what limits a measurement.

A second figure, ``parse only``, feeds the same bytes through h11 + the SSE parser + the
frame classifier with no sockets, to show where the time goes.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from typing import Any

import h11
import trio

from inference_lab.cli_args import CliParser, integer, number
from inference_lab.client.load import LoadConfig, run_load
from inference_lab.client.sse import SSEParser
from inference_lab.client.wire import StreamAccumulator

WORDS = "the of and to in a is that for it was on are be with as at this have".split()


def sse_frames(n: int, model: str) -> list[bytes]:
    """Role frame, ``n`` token frames, finish frame, usage frame, ``[DONE]``."""
    base: dict[str, Any] = {
        "id": "chatcmpl-0c5b0bd4c8f44a4c9b1f5b7a3e0b6f11",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": model,
    }

    def frame(choices: list[Any], **extra: Any) -> bytes:
        obj = {**base, "choices": choices, **extra}
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    frames = [frame([{"index": 0, "delta": {"role": "assistant"}}])]
    for i in range(n):
        frames.append(frame([{"index": 0, "delta": {"content": WORDS[i % len(WORDS)] + " "}}]))
    frames.append(frame([{"index": 0, "delta": {}, "finish_reason": "length"}]))
    usage = {"prompt_tokens": 50, "completion_tokens": n, "total_tokens": 50 + n}
    frames.append(frame([], usage=usage))
    frames.append(b"data: [DONE]\n\n")
    return frames


def chunked(frames: list[bytes]) -> bytes:
    """HTTP/1.1 chunked framing, one chunk per SSE frame, without the terminating chunk."""
    return b"".join(b"%x\r\n%s\r\n" % (len(f), f) for f in frames)


# -- the fake server (child process) -----------------------------------------------------


async def _send_paced(stream: trio.SocketStream, frames: list[bytes], rate: float) -> None:
    """Each frame at its due time (``rate`` per second), everything overdue in one write —
    the way the real server paces a stream, so most frames reach the client one per read."""
    start = trio.current_time()
    i = 0
    while i < len(frames):
        due = start + i / rate
        if trio.current_time() < due:
            await trio.sleep_until(due)
        n = max(1, int((trio.current_time() - start) * rate) + 1 - i)
        await stream.send_all(chunked(frames[i : i + n]))
        i += n


async def _serve_connection(
    cache: dict[tuple[int, str], bytes],
    pace: float,
    stream: trio.SocketStream,
) -> None:
    conn = h11.Connection(h11.SERVER)
    try:
        while True:
            body = b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    return
            request = json.loads(body)
            key = (int(request.get("max_tokens", 16)), str(request.get("model", "m")))
            if key not in cache:
                cache[key] = chunked(sse_frames(*key))
            head = conn.send(
                h11.Response(
                    status_code=200,
                    headers=[("content-type", "text/event-stream"), ("cache-control", "no-cache")],
                )
            )
            assert head is not None
            await stream.send_all(head)
            # The body is pre-framed; h11's chunked writer keeps no byte count, so only the
            # closing chunk has to go through it.
            if pace > 0:
                await _send_paced(stream, sse_frames(*key), pace)
            else:
                await stream.send_all(cache[key])
            await stream.send_all(conn.send(h11.EndOfMessage()) or b"")
            conn.start_next_cycle()
    except (trio.BrokenResourceError, h11.ProtocolError):
        return
    finally:
        await stream.aclose()


async def _serve(pace: float) -> None:
    cache: dict[tuple[int, str], bytes] = {}
    handler = functools.partial(_serve_connection, cache, pace)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, host="127.0.0.1"), handler, 0
        )
        print(listeners[0].socket.getsockname()[1], flush=True)
        # Serve until the parent closes our stdin (or kills us).
        await trio.to_thread.run_sync(sys.stdin.read)
        nursery.cancel_scope.cancel()


# -- the client (this process) -----------------------------------------------------------


def bench_parse_only(frames: int, repeats: int) -> tuple[int, float]:
    """Tokens parsed and CPU seconds for h11 + SSE + classifier on in-memory bytes."""
    body = chunked(sse_frames(frames, "bench")) + b"0\r\n\r\n"
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    data = head + body
    tokens = 0
    t = time.process_time()
    for _ in range(repeats):
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method="POST", target="/", headers=[("host", "x")]))
        conn.send(h11.EndOfMessage())
        parser = SSEParser()
        acc = StreamAccumulator()
        for i in range(0, len(data), 65536):
            conn.receive_data(data[i : i + 65536])
            parts = []
            while True:
                event = conn.next_event()
                if type(event) is h11.Data:
                    parts.append(event.data)
                elif event is h11.NEED_DATA or type(event) is h11.EndOfMessage:
                    break
            for ev in parser.feed(b"".join(parts)):
                tokens += acc.feed(ev.data)
    return tokens, time.process_time() - t


def main() -> int:
    p = CliParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--streams", type=integer(ge=1), default=64, help="responses to read (default 64)"
    )
    p.add_argument(
        "--concurrency", type=integer(ge=1), default=16, help="streams at once (default 16)"
    )
    p.add_argument(
        "--frames", type=integer(ge=1), default=2000, help="tokens per response (default 2000)"
    )
    p.add_argument(
        "--pace",
        type=number(ge=0),
        default=0.0,
        metavar="TOK_S",
        help="tokens/s per stream (default 0: as fast as possible); try --pace 100 "
        "--concurrency 256 --frames 500 for one token per socket read",
    )
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        trio.run(_serve, args.pace)
        return 0

    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--pace", str(args.pace)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        config = LoadConfig(
            url=f"http://127.0.0.1:{port}",
            model="bench",
            concurrency=args.concurrency,
            requests=args.streams,
            max_tokens=args.frames,
            request_timeout=120.0,
            check_model=False,  # the minimal server answers every request with a stream
        )
        cpu0, wall0 = time.process_time(), time.perf_counter()
        result = trio.run(run_load, config)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    finally:
        if server.stdin is not None:
            server.stdin.close()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()

    ok = sum(1 for r in result.records if r.outcome == "ok")
    tokens = sum(len(r.token_times) for r in result.records)
    expected = args.streams * args.frames
    print(
        f"client: {args.streams} streams x {args.frames} frames, {args.concurrency} at once, "
        f"{ok}/{len(result.records)} ok, {tokens}/{expected} tokens timed, "
        f"{result.pool.opened} connections"
    )
    pace = f"paced at {args.pace:g} tokens/s per stream" if args.pace > 0 else "unpaced"
    print(
        f"  {pace}: {tokens / wall:,.0f} tokens/s wall ({wall:.2f} s, client CPU "
        f"{cpu / wall:.0%} of one core), "
        f"{tokens / cpu:,.0f} tokens/s per CPU-second, "
        f"{cpu / tokens * 1e6:.2f} us CPU per token"
    )
    n, parse_cpu = bench_parse_only(args.frames, max(1, 100_000 // args.frames))
    print(
        f"parse only (h11 + SSE + classifier, no sockets): {n / parse_cpu:,.0f} tokens/s, "
        f"{parse_cpu / n * 1e6:.2f} us CPU per token"
    )
    goal = 20_000
    verdict = "meets" if tokens / cpu >= goal and tokens == expected else "MISSES"
    print(f"{verdict} the goal of {goal:,} tokens/s on one core")
    return 0 if verdict == "meets" else 1


if __name__ == "__main__":
    raise SystemExit(main())
