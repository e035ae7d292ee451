"""Hostile inputs against a live server: WebSocket upgrades, requests asking for huge
``n x max_tokens x logprobs``, CORS ``*`` against the control plane, idle HTTP/2 (h2c)
connections.

Against ``inference-lab serve --allowed-origins '*'`` it sends, concurrently:

- WebSocket upgrades on several paths: every one a 404 in the OpenAI envelope;
- requests for 128 choices x 1,000 tokens x 21 logprobs (a 140-byte body that would build
  a body of hundreds of MB): every one a 400 naming the fields, answered at once, and the
  server's RSS stays put;
- CORS requests and preflights from a foreign origin to ``/control/*``: never answered
  with ``Access-Control-Allow-Origin``;
- idle h2c connections (a preface alone, and HEADERS without END_HEADERS): every one closed
  by the server within its deadline.

Then ``/health`` must answer, the log must hold no traceback and the server must hold
nothing.

Then ``/health`` under 128 mixed streams (:func:`health_under_mixed_streams`): closed-loop
clients of five kinds -- plain chat, tool calls, structured output, the Responses API and
chat under a long shared system prompt -- keep the event loop busy for ``--mixed-seconds``
while a probe (a process of its own) asks ``GET /health`` every 50 ms: on a kept-alive
connection, answered where it is read (the connection's quick path); the same through
its route (``/health?via=route``, for comparison); and on a new connection with
``Connection: close``, as a kubelet probes (that one waits for its accept behind the
connections queued before it). Every probe must answer 200 and the kept-alive one's p99
stay under ``--health-p99-ms``; the figures also give the pacing lag and the server's RSS
before and after (its bound: docs/serve.md, "Memory").

    python scripts/stress/hostile.py
    python scripts/stress/hostile.py --rounds 50 --mixed-seconds 60

Only 127.0.0.1; bounded in count and time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # benchkit

from benchkit import get_stats  # noqa: E402
from common import (  # noqa: E402
    MODEL,
    fetch,
    get,
    leaks,
    log_problems,
    post,
    report,
    rss_mb,
    server,
    settle,
)

#: The client preface of HTTP/2 (RFC 9113, 3.4), then an empty SETTINGS frame.
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
#: A HEADERS frame on stream 1 without END_HEADERS (flags 0), its block never finished.
H2_OPEN_HEADERS = b"\x00\x00\x01\x01\x00\x00\x00\x00\x01\x82"


def websocket(path: str) -> bytes:
    return (
        f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nupgrade: websocket\r\n"
        "connection: upgrade\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        "sec-websocket-version: 13\r\n\r\n"
    ).encode()


def cors(method: str, path: str, extra: str = "") -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\norigin: https://evil.example\r\n"
        f"{extra}connection: close\r\n\r\n"
    ).encode()


async def idle_h2(port: int, opening: bytes, within: float) -> bool:
    """Open an h2c connection, send ``opening`` and nothing more: True when the server
    closes it within ``within`` seconds."""
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError:
        return False
    try:
        await stream.send_all(opening)
        with trio.move_on_after(within):
            while await stream.receive_some(65536):
                pass
            return True
        return False
    except (trio.BrokenResourceError, OSError):
        return True
    finally:
        stream.socket.close()


async def one_round(port: int, figures: dict[str, Any], idle_within: float) -> None:
    huge = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "n": 128,
            "max_tokens": 1000,
            "logprobs": True,
            "top_logprobs": 20,
        }
    ).encode()

    async def ws(path: str) -> None:
        response = await fetch(port, websocket(path), 10)
        ok = response.status == 404 and b'"code":"not_found"' in response.body
        figures["websocket_ok" if ok else "websocket_bad"] += 1

    async def work() -> None:
        response = await fetch(port, post("/v1/chat/completions", huge), 10)
        ok = response.status == 400 and b"token entries" in response.body
        figures["huge_work_400" if ok else "huge_work_bad"] += 1

    async def control(request: bytes) -> None:
        response = await fetch(port, request, 10)
        bad = "access-control-allow-origin" in response.headers or response.status == 0
        figures["cors_control_bad" if bad else "cors_control_closed"] += 1

    async def h2(opening: bytes) -> None:
        closed = await idle_h2(port, opening, idle_within)
        figures["h2c_closed" if closed else "h2c_left_open"] += 1

    async with trio.open_nursery() as nursery:
        for path in ("/v1/chat/completions", "/nope", "/control/stats", "/"):
            nursery.start_soon(ws, path)
        for _ in range(8):
            nursery.start_soon(work)
        nursery.start_soon(control, cors("GET", "/control/stats"))
        nursery.start_soon(
            control,
            cors("OPTIONS", "/control/capacity", "access-control-request-method: POST\r\n"),
        )
        nursery.start_soon(h2, H2_PREFACE)
        nursery.start_soon(h2, H2_PREFACE + H2_OPEN_HEADERS)


_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
_WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
#: A long system prompt every "prefix" stream shares (about 1,500 placeholder words).
_SHARED_PREFIX = " ".join(f"rule{i % 97} applies" for i in range(750))


def mixed_requests(client: int) -> bytes:
    """The request of closed-loop client ``client``: one of the five kinds the probe found
    ``/health`` slow behind, in turn (each streamed, a few hundred tokens)."""
    kind = client % 5
    user = [{"role": "user", "content": f"client {client}: go on"}]
    body: dict[str, Any] = {"model": MODEL, "stream": True, "max_tokens": 300}
    if kind == 0:
        body["messages"] = user
    elif kind == 1:
        body.update(messages=user, tools=[_WEATHER], tool_choice="required")
    elif kind == 2:
        body["messages"] = user
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": _SCHEMA, "strict": True},
        }
    elif kind == 3:
        del body["max_tokens"]
        body.update(input=f"client {client}: go on", max_output_tokens=300)
        return post("/v1/responses", json.dumps(body).encode())
    else:
        body["messages"] = [{"role": "system", "content": _SHARED_PREFIX}, *user]
    return post("/v1/chat/completions", json.dumps(body).encode())


async def closed_loop_client(
    port: int, client: int, stop: trio.Event, counts: dict[str, int]
) -> None:
    """Send client ``client``'s request again as each answer ends, until ``stop``."""
    request = mixed_requests(client)
    while not stop.is_set():
        response = await fetch(port, request, 60)
        counts["streams_ok" if response.status == 200 and response.complete else "streams_bad"] += 1


#: The probe (a process of its own, so that this script's 128 clients do not delay it):
#: every 50 ms for argv[2] seconds, in turn, ``GET /health`` and ``GET /health?via=route``
#: (the same answer through the route, for comparison) on one kept-alive connection, and
#: ``GET /health`` with ``Connection: close`` on a new connection, as a kubelet probes;
#: prints the three lists of milliseconds (-1: a failure) as JSON.
_PROBE = r"""
import json, socket, sys, time
port, seconds = int(sys.argv[1]), float(sys.argv[2])
OK = b'{"status":"ok"}'
out = {"quick": [], "routed": [], "fresh": []}

def answer(sock):
    data = b""
    while not data.endswith(OK):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data.startswith(b"HTTP/1.1 200 ") and data.endswith(OK)

kept = socket.create_connection(("127.0.0.1", port), timeout=10)
kept.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")  # accepted before timing
answer(kept)
end = time.monotonic() + seconds
turn = 0
while time.monotonic() < end:
    key = ("quick", "routed", "fresh")[turn % 3]
    started = time.monotonic()
    try:
        if key == "fresh":
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                ok = answer(sock)
        else:
            target = b"/health" if key == "quick" else b"/health?via=route"
            kept.sendall(b"GET " + target + b" HTTP/1.1\r\nhost: x\r\n\r\n")
            ok = answer(kept)
    except OSError:
        ok = False
    out[key].append((time.monotonic() - started) * 1e3 if ok else -1.0)
    turn += 1
    time.sleep(0.05)
print(json.dumps(out))
"""


async def health_probes(port: int, seconds: float) -> dict[str, list[float]]:
    """Run :data:`_PROBE` for ``seconds``: each kind's times (ms)."""
    proc = await trio.run_process(
        [sys.executable, "-c", _PROBE, str(port), str(seconds)], capture_stdout=True
    )
    probes: dict[str, list[float]] = json.loads(proc.stdout)
    return probes


def _percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return round(ordered[min(len(ordered) - 1, int(pct / 100 * len(ordered)))], 2)


async def health_under_mixed_streams(
    url: str, port: int, pid: int, streams: int, seconds: float
) -> dict[str, Any]:
    """The module's last case: ``streams`` mixed closed-loop clients for ``seconds``,
    ``/health`` probed meanwhile; its figures."""
    counts = {"streams_ok": 0, "streams_bad": 0}
    rss_before = rss_mb(pid)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        for client in range(streams):
            nursery.start_soon(closed_loop_client, port, client, stop, counts)
        await trio.sleep(2.0)  # every client admitted and streaming
        probes = await health_probes(port, seconds)
        stats = await get_stats(url)
        stop.set()
    lag = stats["models"][0]["pacing_lag_ms"]

    def spread(values: list[float]) -> list[float]:
        done = [v for v in values if v >= 0]
        return [_percentile(done, 50), _percentile(done, 99), round(max(done, default=-1), 2)]

    return {
        "mixed_streams": streams,
        **counts,
        "health_probes": sum(len(v) for v in probes.values()),
        "health_failed": sum(1 for v in probes.values() for x in v if x < 0),
        "health_kept_alive_p50_p99_max_ms": spread(probes["quick"]),
        "health_route_p50_p99_max_ms": spread(probes["routed"]),
        "health_new_connection_p50_p99_max_ms": spread(probes["fresh"]),
        "pacing_lag_mean_ms": lag["mean"],
        "rss_mb_mixed_before_after": [round(rss_before, 1), round(rss_mb(pid), 1)],
    }


async def main_async(url: str, port: int, args: argparse.Namespace) -> dict[str, Any]:
    figures: dict[str, Any] = dict.fromkeys(
        (
            "websocket_ok",
            "websocket_bad",
            "huge_work_400",
            "huge_work_bad",
            "cors_control_closed",
            "cors_control_bad",
            "h2c_closed",
            "h2c_left_open",
        ),
        0,
    )
    for _ in range(args.rounds):
        await one_round(port, figures, args.idle_within)
    health = await fetch(port, get("/health"), 10)
    figures["health_after"] = health.status
    with trio.move_on_after(15):
        await settle(url)
    figures["held_after"] = sum((await leaks(url)).values())
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument(
        "--idle-within",
        type=float,
        default=15.0,
        metavar="SECONDS",
        help="an idle h2c connection must be closed within this long (default: 15)",
    )
    parser.add_argument(
        "--mixed-streams", type=int, default=128, help="mixed closed-loop streams (default 128)"
    )
    parser.add_argument(
        "--mixed-seconds",
        type=float,
        default=20.0,
        metavar="SECONDS",
        help="how long /health is probed under them (default 20; 0 skips the case)",
    )
    parser.add_argument(
        "--health-p99-ms",
        type=float,
        default=50.0,
        help="/health on a kept-alive connection: its p99 must stay under this (default 50 ms)",
    )
    args = parser.parse_args(argv)
    with server(["--allowed-origins", "*"]) as srv:
        rss_before = rss_mb(srv.pid)
        figures = trio.run(main_async, srv.url, srv.port, args)
        figures["rss_mb_before_after"] = [round(rss_before, 1), round(rss_mb(srv.pid), 1)]
        if args.mixed_seconds > 0:
            figures.update(
                trio.run(
                    health_under_mixed_streams,
                    srv.url,
                    srv.port,
                    srv.pid,
                    args.mixed_streams,
                    args.mixed_seconds,
                )
            )
        code = srv.stop()
        problems = log_problems(srv.log_text())
    figures["exit_code"] = code
    figures["log_problems"] = len(problems)
    bad = ("websocket_bad", "huge_work_bad", "cors_control_bad", "h2c_left_open")
    ok = (
        code == 0
        and not problems
        and not any(figures[k] for k in bad)
        and figures["health_after"] == 200
        and figures["held_after"] == 0
        and figures["rss_mb_before_after"][1] < figures["rss_mb_before_after"][0] + 100
        and (args.mixed_seconds <= 0 or _mixed_ok(figures, args.health_p99_ms))
    )
    report("hostile", figures, ok)
    return 0 if ok else 1


def _mixed_ok(figures: dict[str, Any], p99_ms: float) -> bool:
    """The mixed-streams case passed: every probe answered 200, the p99 of ``/health`` on
    a kept-alive connection (the quick path) is under ``p99_ms``, no stream failed."""
    return (
        figures["health_failed"] == 0
        and figures["health_probes"] > 0
        and figures["health_kept_alive_p50_p99_max_ms"][1] < p99_ms
        and figures["streams_bad"] == 0
    )


if __name__ == "__main__":
    sys.exit(main())
