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
  by the server within its deadline;
- the routes vLLM clients added (:func:`api_parity_round`): a Messages body of tens of
  thousands of messages and malformed ``tool_result`` blocks (answered in Anthropic's
  envelope), a completions batch of 2,048 scored prompts, bodies ``/invocations`` cannot
  place, a browser page's bodiless ``/sleep``: each a 200 or a 4xx in its API's
  envelope, answered within its deadline, never a 500;
- the pooling routes (:func:`pooling_round`, the model served as a pooling model): a
  rerank and a score of 100,000 documents (a 400 before any work), a rerank of 2,048,
  mismatched score pairs and malformed pooling bodies: each a 200 or a 400.

Then (``hostile_generation.py``, unless ``--skip-generation``) the issue-45 cases one by
one: hostile schemas and patterns with ``/health`` probed meanwhile, distinct large
patterns and a full Responses store with the server's RSS, and, without a server, empty
secrets and the offline tools' hostile inputs.

Then ``/health`` must answer, the log must hold no traceback and the server must hold
nothing.

Then two KV-event cases, each against its own server (``--kv-events-endpoint``):

- a replay flood: the replay buffer filled, then 2 s of replay requests and 20,000 replay
  requests from a client that never reads the answers, while live requests trickle in:
  the worst delay of a live batch must stay under ``--kv-stall-limit``;
- a subscriber that never reads: the server's RSS before and after rounds of requests
  must grow by less than ``--kv-rss-limit`` MB (the PUB socket's high-water mark holds).

    python scripts/stress/hostile.py
    python scripts/stress/hostile.py --rounds 50
    python scripts/stress/hostile.py --case kv-flood --kv-flood-requests 20000
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
import itertools
import json
import multiprocessing
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # benchkit

from benchkit import get_stats  # noqa: E402
from common import (  # noqa: E402
    MODEL,
    Server,
    chat_request,
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
from hostile_generation import generation_cases, offline_cases  # noqa: E402

#: The cases of :func:`api_parity_round` (each counted ``<case>_ok`` / ``<case>_bad``).
API_PARITY_CASES = (
    "messages_huge",
    "count_tokens_huge",
    "tool_result_malformed",
    "scored_batch",
    "invocations_junk",
    "sleep_from_page",
)
#: The cases of :func:`pooling_round` (each counted ``<case>_ok`` / ``<case>_bad``).
POOLING_CASES = ("rerank_100k", "score_100k", "rerank_2048", "score_mismatch", "pooling_junk")
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


def _anthropic(response: Any, status: int) -> bool:
    """Whether ``response`` is ``status`` in Anthropic's error envelope."""
    if response.status != status:
        return False
    try:
        body = response.json()
    except ValueError:
        return False
    return body.get("type") == "error" and isinstance(body.get("error"), dict)


async def api_parity_round(port: int, figures: dict[str, Any]) -> None:
    """Hostile input for the Messages API, batched completions, ``/invocations`` and
    sleep mode: bounded work, the right envelope, never a 500 or a hang."""
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(55_000)]
    huge_messages = json.dumps(
        {"model": MODEL, "max_tokens": 4, "messages": many}, separators=(",", ":")
    ).encode()
    bad_results = [
        {"type": "tool_result"},
        {"type": "tool_result", "tool_use_id": "t", "content": {"x": 1}},
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": 7}]},
        {"type": "tool_result", "tool_use_id": "t", "is_error": "yes"},
        {"type": "tool_result", "tool_use_id": ["t"] * 1000},
    ]
    scored = json.dumps(
        {
            "model": MODEL,
            "prompt": [list(range(200))] * 2048,
            "echo": True,
            "logprobs": 1,
            "max_tokens": 0,
        }
    ).encode()

    async def one(name: str, request: bytes, ok: Any) -> None:
        response = await fetch(port, request, 30)
        figures[f"{name}_ok" if ok(response) else f"{name}_bad"] += 1

    sleep_from_page = (
        b"POST /sleep HTTP/1.1\r\nhost: 127.0.0.1\r\norigin: https://evil.example\r\n"
        b"content-length: 0\r\nconnection: close\r\n\r\n"
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            one,
            "messages_huge",
            post("/v1/messages", huge_messages),
            lambda r: r.status == 200 or _anthropic(r, 400) or _anthropic(r, 413),
        )
        nursery.start_soon(
            one,
            "count_tokens_huge",
            post("/v1/messages/count_tokens", huge_messages),
            lambda r: r.status == 200 or _anthropic(r, 400) or _anthropic(r, 413),
        )
        for block in bad_results:
            body = {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [block]}],
            }
            nursery.start_soon(
                one,
                "tool_result_malformed",
                post("/v1/messages", json.dumps(body).encode()),
                lambda r: _anthropic(r, 400),
            )
        nursery.start_soon(
            one,
            "scored_batch",
            post("/v1/completions", scored),
            lambda r: r.status in (200, 400) and r.complete,
        )
        for junk in (b'{"nothing":1}', b"[1,2]", b'{"messages":"x"}'):
            nursery.start_soon(
                one, "invocations_junk", post("/invocations", junk), lambda r: r.status == 400
            )
        nursery.start_soon(one, "sleep_from_page", sleep_from_page, lambda r: r.status == 415)


async def pooling_round(port: int, figures: dict[str, Any]) -> None:
    """Hostile input for the pooling routes: bounded work, OpenAI's envelope, never a
    500 or a hang."""
    docs = ["d"] * 100_000

    def body(value: dict[str, Any]) -> bytes:
        return json.dumps({"model": MODEL, **value}, separators=(",", ":")).encode()

    def refused(response: Any) -> bool:
        if response.status != 400:
            return False
        try:
            return isinstance(response.json().get("error"), dict)
        except ValueError:
            return False

    async def one(name: str, path: str, request: bytes, ok: Any) -> None:
        response = await fetch(port, post(path, request), 30)
        figures[f"{name}_ok" if ok(response) else f"{name}_bad"] += 1

    junk = (
        ("/pooling", {"input": [[-1]]}),
        ("/pooling", {"input": "x", "task": "plugin"}),
        ("/v1/rerank", {"query": {"text": 1}, "documents": ["x"]}),
        ("/v1/rerank", {"query": "q", "documents": "x" * 10, "top_n": "all"}),
        ("/classify", {"messages": [{"role": "user", "content": "x"}]}),
        ("/v1/score", {"text_1": [], "text_2": ["x"]}),
    )
    async with trio.open_nursery() as nursery:
        rerank = body({"query": "q", "documents": docs})
        nursery.start_soon(one, "rerank_100k", "/v1/rerank", rerank, refused)
        score = body({"text_1": "q", "text_2": docs})
        nursery.start_soon(one, "score_100k", "/score", score, refused)
        full = body({"query": "q", "documents": ["a document"] * 2048, "top_n": 3})
        nursery.start_soon(
            one, "rerank_2048", "/v2/rerank", full, lambda r: r.status == 200 and r.complete
        )
        mismatch = body({"text_1": ["a", "b", "c"], "text_2": ["a", "b"]})
        nursery.start_soon(one, "score_mismatch", "/v1/score", mismatch, refused)
        for path, value in junk:
            nursery.start_soon(one, "pooling_junk", path, body(value), refused)


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
            *(f"{name}_{outcome}" for name in API_PARITY_CASES for outcome in ("ok", "bad")),
            *(f"{name}_{outcome}" for name in POOLING_CASES for outcome in ("ok", "bad")),
        ),
        0,
    )
    for _ in range(args.rounds):
        await one_round(port, figures, args.idle_within)
    figures["rss_mb_before_after"] = [args.rss_before, round(rss_mb(args.pid), 1)]
    if not args.skip_generation:
        figures["generation_ok"] = await generation_cases(port, args.pid, figures)
    for _ in range(max(1, args.rounds // 10)):
        await api_parity_round(port, figures)
        await pooling_round(port, figures)
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
    add_kv_arguments(parser)
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
    parser.add_argument(
        "--skip-generation",
        action="store_true",
        help="leave out the generation, store and offline-tool cases (hostile_generation.py)",
    )
    args = parser.parse_args(argv)
    if args.case != "http":
        return kv_main(args)
    figures_offline: dict[str, Any] = {}
    offline_ok = args.skip_generation or offline_cases(figures_offline)
    with server(["--allowed-origins", "*", "--pooling-models", MODEL]) as srv:
        args.pid = srv.pid
        args.rss_before = round(rss_mb(srv.pid), 1)
        figures = trio.run(main_async, srv.url, srv.port, args)
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
    bad = (
        "websocket_bad",
        "huge_work_bad",
        "cors_control_bad",
        "h2c_left_open",
        *(f"{name}_bad" for name in API_PARITY_CASES),
        *(f"{name}_bad" for name in POOLING_CASES),
    )
    ok = (
        code == 0
        and not problems
        and not any(figures[k] for k in bad)
        and figures["health_after"] == 200
        and figures["held_after"] == 0
        and figures["rss_mb_before_after"][1] < figures["rss_mb_before_after"][0] + 100
        and (args.mixed_seconds <= 0 or _mixed_ok(figures, args.health_p99_ms))
        and figures.get("generation_ok", True)
        and offline_ok
    )
    report("hostile", figures, ok)
    if args.case == "http" and not args.http_only:
        return max(int(not ok), kv_main(args))
    return 0 if ok else 1


# -- KV events: a replay flood and a subscriber that never reads ---------------------------------
#
# Against ``--kv-events-endpoint`` (the server's PUB socket connects to a SUB socket bound
# here on 127.0.0.1) and ``--kv-events-replay-endpoint`` (the server binds a ROUTER on a
# free loopback port). Live events come from a trickle of chat requests with distinct
# prompts (each stores new blocks). The flooders run in their own processes so that their
# busy loops do not starve this process's receiver.

#: A live batch is "flowing again" once one arrives this soon after it was published (s).
KV_FRESH = 0.5


def free_port() -> int:
    """A loopback TCP port free a moment ago (the server binds it next)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def kv_flood(endpoint: str, seconds: float, count: int) -> None:
    """A replay flooder (its own process): requests for every buffered batch
    (``start = 0``) from one DEALER that never reads its answers, for ``seconds`` or
    ``count`` requests, whichever is given; queued requests are flushed before exit."""
    import zmq

    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.SNDHWM, max(count, 1000) + 1000)
    dealer.connect(endpoint)
    request = [b"", (0).to_bytes(8, "big")]
    sent = 0
    deadline = time.monotonic() + seconds
    while (sent < count) if count else (time.monotonic() < deadline):
        try:
            dealer.send_multipart(request, flags=zmq.NOBLOCK)
            sent += 1
        except zmq.Again:
            time.sleep(0.001)
    dealer.close(linger=10_000)
    ctx.term()
    print(f"kv_flood: {sent} replay requests sent", file=sys.stderr, flush=True)


class LiveReceiver:
    """A SUB socket bound on loopback that records, for every batch it gets, its sequence
    number, when it was published (the batch's ``ts``) and when it arrived. A thread of
    its own owns the socket; :meth:`stop` ends it."""

    def __init__(self, ctx: Any, *, read: bool = True) -> None:
        import msgspec
        import zmq

        self._zmq = zmq
        self._decode = msgspec.msgpack.Decoder().decode
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        port = self.sub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.arrivals: list[tuple[int, float, float]] = []  # (seq, published, arrived)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run if read else self._idle, daemon=True)
        self._thread.start()

    def _idle(self) -> None:
        self._stop.wait()
        self.sub.close(linger=0)

    def _run(self) -> None:
        zmq = self._zmq
        while not self._stop.is_set():
            if not self.sub.poll(50):
                continue
            while True:
                try:
                    _, seq, payload = self.sub.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                arrived = time.time()
                ts = self._decode(payload)[0]
                self.arrivals.append((int.from_bytes(seq, "big"), ts, arrived))
        self.sub.close(linger=0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def worst_delay(self, since: float) -> float:
        """The longest a batch published after ``since`` took to arrive (of those
        arrived); 0 when none arrived."""
        delays = [arr - ts for _, ts, arr in list(self.arrivals) if ts >= since]
        return max(delays, default=0.0)

    def gaps(self) -> int:
        """Sequence numbers skipped so far (batches the publisher dropped or never sent)."""
        seqs = [s for s, _, _ in list(self.arrivals)]
        return sum(b - a - 1 for a, b in itertools.pairwise(seqs) if b > a + 1)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def trickle(port: int, stop: trio.Event, every: float, tag: str) -> int:
    """One chat request with a prompt of its own every ``every`` seconds (up to 16 at
    once) until ``stop``; returns how many were answered 200."""
    done = 0
    limit = trio.Semaphore(16)

    async def one(i: int) -> None:
        nonlocal done
        async with limit:
            prompt = f"{tag} {i}: " + "tell me more " * 40
            response = await fetch(port, chat_request(1, stream=False, content=prompt), 30)
            done += response.status == 200

    async with trio.open_nursery() as nursery:
        i = 0
        while not stop.is_set():
            nursery.start_soon(one, i)
            i += 1
            await trio.sleep(every)
    return done


async def fill(port: int, n: int, tag: str) -> int:
    """``n`` chat requests with prompts of their own, 32 at once; how many got 200."""
    done = 0
    limit = trio.Semaphore(32)

    async def one(i: int) -> None:
        nonlocal done
        async with limit:
            prompt = f"{tag} {i}: " + "tell me more " * 40
            response = await fetch(port, chat_request(1, stream=False, content=prompt), 60)
            done += response.status == 200

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    return done


async def flood_round(
    srv: Server, live: LiveReceiver, replay: str, seconds: float, count: int, cap: float
) -> dict[str, Any]:
    """A flood (:func:`kv_flood`) while live requests trickle in: the worst delay of a
    live batch from the flood's start until live batches arrive fresh again (at most
    ``cap`` seconds after the flood), the server's CPU seconds meanwhile."""
    ctx = multiprocessing.get_context("spawn")
    flooder = ctx.Process(target=kv_flood, args=(replay, seconds, count), daemon=True)
    stop = trio.Event()
    out: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trickle, srv.port, stop, 0.02, f"live {seconds} {count}")
        await trio.sleep(1.0)
        start, cpu0 = time.time(), cpu_seconds(srv.pid)
        flooder.start()
        await trio.to_thread.run_sync(flooder.join)
        flood_end = time.time()
        while time.time() < flood_end + cap:
            recent = [a for a in list(live.arrivals) if a[2] > flood_end]
            if recent and recent[-1][2] - recent[-1][1] < KV_FRESH:
                break
            await trio.sleep(0.05)
        out["flood_s"] = round(flood_end - start, 2)
        out["recovered"] = time.time() < flood_end + cap
        stall = live.worst_delay(start)
        out["stall_s"] = round(stall, 2) if out["recovered"] else f">{time.time() - start:.0f}"
        out["server_cpu_s"] = round(cpu_seconds(srv.pid) - cpu0, 2)
        out["wall_s"] = round(time.time() - start, 2)
        stop.set()
    return out


def kv_flood_case(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    """The replay flood: fill the replay buffer, then a ``--kv-flood-seconds`` flood and a
    ``--kv-flood-requests`` flood, each while live requests trickle in."""
    import zmq

    ctx = zmq.Context()
    live = LiveReceiver(ctx)
    replay = f"tcp://127.0.0.1:{free_port()}"
    figures: dict[str, Any] = {}
    try:
        flags = ["--kv-events-endpoint", live.endpoint, "--kv-events-replay-endpoint", replay]
        with server(flags) as srv:

            async def run() -> None:
                figures["filled"] = await fill(srv.port, args.kv_fill, "fill")
                await trio.sleep(1.0)
                base = time.time()
                stop = trio.Event()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(trickle, srv.port, stop, 0.02, "baseline")
                    await trio.sleep(3.0)
                    stop.set()
                figures["baseline_delay_s"] = round(live.worst_delay(base), 3)
                cap = args.kv_stall_cap
                figures["timed"] = await flood_round(
                    srv, live, replay, args.kv_flood_seconds, 0, cap
                )
                figures["counted"] = await flood_round(
                    srv, live, replay, 0.0, args.kv_flood_requests, cap
                )
                health = await fetch(srv.port, get("/health"), 10)
                figures["health_after"] = health.status

            trio.run(run)
            figures["batches_received"] = len(live.arrivals)
            figures["sequence_gaps"] = live.gaps()
            figures["exit_code"] = srv.stop()
            figures["log_problems"] = len(log_problems(srv.log_text()))
    finally:
        live.stop()
        ctx.destroy(linger=0)
    ok = (
        figures.get("exit_code") == 0
        and figures.get("health_after") == 200
        and not figures.get("log_problems")
        and all(figures[k]["recovered"] for k in ("timed", "counted"))
        and all(float(figures[k]["stall_s"]) <= args.kv_stall_limit for k in ("timed", "counted"))
    )
    return figures, ok


def kv_stalled_case(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    """A subscriber that never reads: the server's RSS before and after
    ``--kv-stalled-requests`` requests, twice (the second run must not grow it much
    further: the socket's high-water mark holds)."""
    import zmq

    ctx = zmq.Context()
    stalled = LiveReceiver(ctx, read=False)
    figures: dict[str, Any] = {}
    try:
        with server(["--kv-events-endpoint", stalled.endpoint, *args.kv_server_args]) as srv:
            rss = [round(rss_mb(srv.pid), 1)]

            async def run() -> None:
                for k in range(args.kv_stalled_rounds):
                    figures[f"answered_{k}"] = await fill(
                        srv.port, args.kv_stalled_requests, f"stalled {k}"
                    )
                    await trio.sleep(1.0)
                    rss.append(round(rss_mb(srv.pid), 1))
                health = await fetch(srv.port, get("/health"), 10)
                figures["health_after"] = health.status

            trio.run(run)
            figures["rss_mb"] = rss
            figures["exit_code"] = srv.stop()
            figures["log_problems"] = len(log_problems(srv.log_text()))
    finally:
        stalled.stop()
        ctx.destroy(linger=0)
    rss = figures.get("rss_mb", [0.0, float("inf")])
    ok = (
        figures.get("exit_code") == 0
        and figures.get("health_after") == 200
        and not figures.get("log_problems")
        and rss[-1] - rss[0] <= args.kv_rss_limit
    )
    return figures, ok


def add_kv_arguments(parser: argparse.ArgumentParser) -> None:
    """The KV-event cases' flags."""
    parser.add_argument(
        "--case",
        choices=("http", "kv-flood", "kv-stalled", "kv"),
        default="http",
        help="http: the HTTP cases, then both KV-event cases (unless --http-only); kv: "
        "both KV-event cases; kv-flood / kv-stalled: one of them",
    )
    parser.add_argument("--http-only", action="store_true", help="skip the KV-event cases")
    parser.add_argument(
        "--kv-fill", type=int, default=3000, help="requests filling the replay buffer"
    )
    parser.add_argument("--kv-flood-seconds", type=float, default=2.0)
    parser.add_argument("--kv-flood-requests", type=int, default=20_000)
    parser.add_argument(
        "--kv-stall-cap",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="stop watching a stalled live stream after this long",
    )
    parser.add_argument(
        "--kv-stall-limit",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="the worst live-batch delay a flood may cause",
    )
    parser.add_argument("--kv-stalled-requests", type=int, default=3000)
    parser.add_argument("--kv-stalled-rounds", type=int, default=2)
    parser.add_argument("--kv-rss-limit", type=float, default=60.0, metavar="MB")
    parser.add_argument(
        "--kv-server-args",
        nargs="*",
        default=[],
        metavar="ARG",
        help="more serve flags for the stalled-subscriber server",
    )


def kv_main(args: argparse.Namespace) -> int:
    """Run the KV-event cases ``args.case`` asks for; 1 if one failed."""
    cases = {"kv-flood": kv_flood_case, "kv-stalled": kv_stalled_case}
    chosen = list(cases) if args.case in ("http", "kv") else [args.case]
    failed = 0
    for name in chosen:
        figures, ok = cases[name](args)
        report(f"hostile-{name}", figures, ok)
        failed += not ok
    return 1 if failed else 0


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
