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

Then (``hostile_generation.py``, unless ``--skip-generation``) the issue-45 cases one by
one: hostile schemas and patterns with ``/health`` probed meanwhile, distinct large
patterns and a full Responses store with the server's RSS, and, without a server, empty
secrets and the offline tools' hostile inputs.

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
from hostile_generation import generation_cases, offline_cases  # noqa: E402

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
    figures["rss_mb_before_after"] = [args.rss_before, round(rss_mb(args.pid), 1)]
    if not args.skip_generation:
        figures["generation_ok"] = await generation_cases(port, args.pid, figures)
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
        "--skip-generation",
        action="store_true",
        help="leave out the generation, store and offline-tool cases (hostile_generation.py)",
    )
    args = parser.parse_args(argv)
    figures_offline: dict[str, Any] = {}
    offline_ok = args.skip_generation or offline_cases(figures_offline)
    with server(["--allowed-origins", "*"]) as srv:
        args.pid = srv.pid
        args.rss_before = round(rss_mb(srv.pid), 1)
        figures = trio.run(main_async, srv.url, srv.port, args)
        code = srv.stop()
        problems = log_problems(srv.log_text())
    figures["exit_code"] = code
    figures["log_problems"] = len(problems)
    figures.update(figures_offline)
    bad = ("websocket_bad", "huge_work_bad", "cors_control_bad", "h2c_left_open")
    ok = (
        code == 0
        and not problems
        and not any(figures[k] for k in bad)
        and figures["health_after"] == 200
        and figures["held_after"] == 0
        and figures["rss_mb_before_after"][1] < figures["rss_mb_before_after"][0] + 100
        and figures.get("generation_ok", True)
        and offline_ok
    )
    report("hostile", figures, ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
