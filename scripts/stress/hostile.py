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

Then ``/health`` must answer, the log must hold no traceback and the server must hold
nothing.

    python scripts/stress/hostile.py
    python scripts/stress/hostile.py --rounds 50

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
    args = parser.parse_args(argv)
    with server(["--allowed-origins", "*", "--pooling-models", MODEL]) as srv:
        rss_before = rss_mb(srv.pid)
        figures = trio.run(main_async, srv.url, srv.port, args)
        figures["rss_mb_before_after"] = [round(rss_before, 1), round(rss_mb(srv.pid), 1)]
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
    )
    report("hostile", figures, ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
