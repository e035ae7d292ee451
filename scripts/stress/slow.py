"""Slow clients: bodies that trickle, bodies in tiny chunks, readers that stop reading,
headers that never end; meanwhile a probe checks that everyone else is still served.

- ``trickle``: ``--slow`` clients send their body a byte at a time (every 50 ms) to a
  completion route and to ``/control/capacity``; each must get its 408 at the body
  deadline (``--body-timeout``, 2 s here) and the connection must close.
- ``chunks``: one client sends a 5 MB body in 4-byte chunks as fast as it can; it must be
  refused (413 ``request_too_fragmented`` after 16,384 pieces, or 408 at the deadline,
  whichever comes first); the figures are the time to the answer and the server CPU it
  cost.
- ``readers``: ``--slow`` streams whose clients never read (100,000 tokens each); then
  they leave.
- ``headers``: ``--slow`` connections that send a header byte a second (slowloris); the
  body deadline does not cover the header phase, hypercorn's keep-alive timer does (5 s:
  a connection counts as idle until its request head is complete); the figures are how
  many the server closed within the phase and after how long.

Throughout, a probe times ``GET /health`` and a short stream; at the end the server must
hold nothing. Prints the figures of each phase, RSS before/after, log problems.

    python scripts/stress/slow.py
    python scripts/stress/slow.py --slow 200 --phase-seconds 20

Only 127.0.0.1; each phase is bounded by ``--phase-seconds``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # benchkit

from benchkit import get_stats  # noqa: E402
from common import (  # noqa: E402
    CHAT,
    MODEL,
    chat_request,
    fetch,
    get,
    leaks,
    log_problems,
    raise_fd_limit,
    read_response,
    report,
    rss_mb,
    server,
    settle,
)

BODY_TIMEOUT = 2.0


class Probe:
    """Times ``GET /health`` and a 20-token stream every 200 ms while a phase runs."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.health_ms: list[float] = []
        self.stream_ms: list[float] = []
        self.failures = 0

    async def run(self) -> None:
        while True:
            start = time.perf_counter()
            health = await fetch(self.port, get("/health"), 10)
            self.health_ms.append((time.perf_counter() - start) * 1000)
            start = time.perf_counter()
            stream = await fetch(self.port, chat_request(20), 10)
            self.stream_ms.append((time.perf_counter() - start) * 1000)
            if health.status != 200 or stream.status != 200 or b"[DONE]" not in stream.body:
                self.failures += 1
            await trio.sleep(0.2)

    def figures(self) -> dict[str, Any]:
        def p(values: list[float], q: float) -> float:
            return round(statistics.quantiles(values, n=100)[q - 1], 1) if len(values) > 2 else 0

        return {
            "probe_health_ms_p50_p99": [p(self.health_ms, 50), p(self.health_ms, 99)],
            "probe_stream_ms_p50_p99": [p(self.stream_ms, 50), p(self.stream_ms, 99)],
            "probe_failures": self.failures,
        }


async def with_probe(port: int, phase: Any) -> dict[str, Any]:
    probe = Probe(port)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(probe.run)
        figures: dict[str, Any] = await phase()
        nursery.cancel_scope.cancel()
    return {**figures, **probe.figures()}


async def trickle(port: int, path: str, answers: list[tuple[int, float]]) -> None:
    body = b'{"model":"' + MODEL.encode() + b'","max_num_seqs":2}'
    head = (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body) + 100}\r\n\r\n"
    ).encode()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    start = trio.current_time()
    data = b""
    try:
        await stream.send_all(head)
        with trio.move_on_after(BODY_TIMEOUT * 3):
            for byte in body + b" " * 100:
                await stream.send_all(bytes([byte]))
                with trio.move_on_after(0.05):
                    chunk = await stream.receive_some(65536)
                    data += chunk
                    if not chunk or b"\r\n\r\n" in data:
                        break
            while chunk := await stream.receive_some(65536):
                data += chunk
    except (trio.BrokenResourceError, OSError):
        pass
    finally:
        stream.socket.close()
    answers.append((read_response(data).status, trio.current_time() - start))


async def chunked_flood(port: int, total: int, seconds: float) -> dict[str, Any]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    head = (
        f"POST {CHAT} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        "transfer-encoding: chunked\r\n\r\n"
    ).encode()
    piece = b"4\r\n    \r\n" * 4096  # 4096 chunks of 4 bytes
    sent = 0
    data = b""
    start = trio.current_time()
    answered = math.nan

    async def reader() -> None:
        nonlocal data, answered
        try:
            while chunk := await stream.receive_some(65536):
                if not data:
                    answered = trio.current_time() - start
                data += chunk
        except (trio.BrokenResourceError, OSError):
            pass
        nursery.cancel_scope.cancel()  # the server answered and closed

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        with trio.move_on_after(seconds):
            try:
                await stream.send_all(head)
                while sent < total:
                    await stream.send_all(piece)
                    sent += 4 * 4096
            except (trio.BrokenResourceError, OSError):
                pass  # the server answered and closed: the reader has (or will get) it
            await trio.sleep_forever()  # until the reader is done or time is up
        nursery.cancel_scope.cancel()
    stream.socket.close()
    return {
        "status": read_response(data).status,
        "answer_s": round(answered, 2),
        "body_bytes_sent": sent,
    }


async def phases(url: str, port: int, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}

    async def trickle_phase() -> dict[str, Any]:
        answers: list[tuple[int, float]] = []
        async with trio.open_nursery() as nursery:
            for i in range(args.slow):
                path = CHAT if i % 2 else "/control/capacity"
                nursery.start_soon(trickle, port, path, answers)
        times = [t for _, t in answers]
        return {
            "clients": len(answers),
            "408s": sum(1 for status, _ in answers if status == 408),
            "answer_s_min_max": [round(min(times), 2), round(max(times), 2)],
        }

    out["trickle"] = await with_probe(port, trickle_phase)

    async def chunks_phase() -> dict[str, Any]:
        cpu = (await get_stats(url))["process"]["cpu_seconds"]
        figures = await chunked_flood(port, 5 * 1024 * 1024, args.phase_seconds)
        figures["server_cpu_s"] = round((await get_stats(url))["process"]["cpu_seconds"] - cpu, 2)
        return figures

    out["chunks"] = await with_probe(port, chunks_phase)

    async def readers_phase() -> dict[str, Any]:
        streams = []
        for _ in range(args.slow):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(chat_request(100_000))
            streams.append(stream)
        await trio.sleep(args.phase_seconds)
        stats = await get_stats(url)
        for stream in streams:
            stream.socket.close()
        return {"clients": len(streams), "open_streams_seen": stats["delivery"]["open_streams"]}

    out["readers"] = await with_probe(port, readers_phase)

    async def headers_phase() -> dict[str, Any]:
        held: list[float] = []  # seconds until the server closed each connection

        async def slowloris() -> None:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            start = trio.current_time()
            try:
                await stream.send_all(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nx-slow: ")
                while True:
                    await trio.sleep(1.0)
                    await stream.send_all(b"x")
            except (trio.BrokenResourceError, OSError):
                held.append(trio.current_time() - start)
            finally:
                stream.socket.close()

        with trio.move_on_after(args.phase_seconds):
            async with trio.open_nursery() as nursery:
                for _ in range(args.slow):
                    nursery.start_soon(slowloris)
        return {
            "clients": args.slow,
            "closed_by_server": len(held),
            "held_s_max": round(max(held), 1) if held else None,
        }

    out["headers"] = await with_probe(port, headers_phase)
    with trio.move_on_after(15):
        await settle(url)
    out["held_after"] = await leaks(url)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slow", type=int, default=50, help="slow clients per phase")
    parser.add_argument("--phase-seconds", type=float, default=8.0)
    args = parser.parse_args(argv)
    raise_fd_limit()
    with server(["--body-timeout", str(BODY_TIMEOUT)]) as srv:
        rss_before = rss_mb(srv.pid)
        result = trio.run(phases, srv.url, srv.port, args)
        rss_after = rss_mb(srv.pid)
        code = srv.stop()
        problems = log_problems(srv.log_text())
    print(json.dumps(result), file=sys.stderr)
    trickled = result["trickle"]
    ok = trickled["408s"] == trickled["clients"] == args.slow
    ok = ok and trickled["answer_s_min_max"][1] < BODY_TIMEOUT + 1.5
    ok = ok and result["chunks"]["status"] in (408, 413)
    ok = ok and all(result[p]["probe_failures"] == 0 for p in ("trickle", "chunks", "readers"))
    ok = ok and not any(result["held_after"].values()) and not problems and code == 0
    report(
        "slow",
        {
            **{f"{name}": result[name] for name in ("trickle", "chunks", "readers", "headers")},
            "leaked": sum(result["held_after"].values()),
            "rss_mb_before_after": [round(rss_before, 1), round(rss_after, 1)],
            "log_problems": len(problems),
            "exit_code": code,
        },
        ok,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
