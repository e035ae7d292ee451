"""Burst: 1,000 clients connect and send a streaming request at the same moment, against
each of ``--max-num-seqs 4 --max-waiting 64``, ``16 / 8`` and ``2 / 2``.

Every client must get an answer within a few seconds: exactly ``max_num_seqs +
max_waiting`` streams admitted in every round (seats in the batch plus waiting places;
each asks for 100,000 tokens, so none ends during the burst) and the rest byte-identical
529s. Then the admitted clients leave, and the server must hold nothing
(``/control/stats``). Per round it prints: answered, 200s, 529s, others, the time to the
last answer, the kernel's listen-queue overflows during the burst
(``TcpExtListenOverflows``), and what the server still held.

    python scripts/stress/burst.py                      # 3 rounds of 1,000 per size
    python scripts/stress/burst.py --clients 500 --rounds 1 --sizes 16/8

Only 127.0.0.1; each round is bounded (``--answer-within`` seconds for the answers).
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
    chat_request,
    leaks,
    log_problems,
    raise_fd_limit,
    read_response,
    report,
    rss_mb,
    server,
    settle,
)

#: (max_num_seqs, max_waiting) of each server the burst runs against.
SIZES = ((4, 64), (16, 8), (2, 2))


def listen_overflows() -> int:
    """The kernel's count of connections dropped because a listen queue was full."""
    lines = Path("/proc/net/netstat").read_text().splitlines()
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            table = dict(zip(names.split()[1:], values.split()[1:], strict=True))
            return int(table.get("ListenOverflows", 0))
    return 0


async def one_round(port: int, clients: int, answer_within: float) -> dict[str, Any]:
    request = chat_request(100_000)
    heads: list[tuple[float, bytes]] = []
    admitted: list[trio.SocketStream] = []
    start = trio.current_time()

    async def client() -> None:
        try:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
        except OSError:
            return
        data = b""
        try:
            await stream.send_all(request)
            while b"\r\n\r\n" not in data and (chunk := await stream.receive_some(65536)):
                data += chunk
            if data.startswith(b"HTTP/1.1 200"):
                admitted.append(stream)  # keep it open: the request stays admitted
                heads.append((trio.current_time() - start, data))
                return
            while chunk := await stream.receive_some(65536):
                data += chunk
        except (trio.BrokenResourceError, OSError):
            pass
        heads.append((trio.current_time() - start, data))
        await stream.aclose()

    before = listen_overflows()
    with trio.move_on_after(answer_within):
        async with trio.open_nursery() as nursery:
            for _ in range(clients):
                nursery.start_soon(client)
    overflows = listen_overflows() - before
    statuses = [read_response(data).status for _, data in heads]
    refusals = {read_response(data).body for _, data in heads if data.startswith(b"HTTP/1.1 529")}
    last = max((t for t, _ in heads), default=float("nan"))
    for stream in admitted:
        await stream.aclose()
    return {
        "answered": len(heads),
        "admitted": statuses.count(200),
        "refused_529": statuses.count(529),
        "other": len(statuses) - statuses.count(200) - statuses.count(529),
        "distinct_529_bodies": len(refusals),
        "last_answer_s": round(last, 2),
        "listen_overflows": overflows,
    }


async def main_async(url: str, port: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    rounds = []
    for _ in range(args.rounds):
        figures = await one_round(port, args.clients, args.answer_within)
        with trio.move_on_after(15):
            await settle(url)
        figures["held_after"] = await leaks(url)
        rounds.append(figures)
        print(json.dumps(figures), file=sys.stderr)
    return rounds


def parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for item in text.split(","):
        seqs, _, waiting = item.partition("/")
        sizes.append((int(seqs), int(waiting)))
    return sizes


def run_size(args: argparse.Namespace, seqs: int, waiting: int) -> bool:
    """The rounds against one server; True when every round was exact and clean."""
    flags = ["--max-num-seqs", str(seqs), "--max-waiting", str(waiting)]
    with server(flags) as srv:
        rss_before = rss_mb(srv.pid)
        rounds = trio.run(main_async, srv.url, srv.port, args)
        rss_after = rss_mb(srv.pid)
        code = srv.stop()
        problems = log_problems(srv.log_text())
    bound = seqs + waiting
    ok = code == 0 and not problems
    for r in rounds:
        ok = ok and r["answered"] == args.clients and r["admitted"] == min(bound, args.clients)
        ok = ok and r["refused_529"] == args.clients - r["admitted"] and r["other"] == 0
        ok = ok and r["distinct_529_bodies"] <= 1 and not any(r["held_after"].values())
        ok = ok and r["last_answer_s"] <= args.last_answer_max
    report(
        f"burst {seqs}/{waiting}",
        {
            "model": MODEL,
            "max_num_seqs": seqs,
            "max_waiting": waiting,
            "clients": args.clients,
            "rounds": len(rounds),
            "admitted": [r["admitted"] for r in rounds],
            "refused_529": [r["refused_529"] for r in rounds],
            "other": [r["other"] for r in rounds],
            "last_answer_s": [r["last_answer_s"] for r in rounds],
            "listen_overflows": [r["listen_overflows"] for r in rounds],
            "leaked": [sum(r["held_after"].values()) for r in rounds],
            "rss_mb_before_after": [round(rss_before, 1), round(rss_after, 1)],
            "exit_code": code,
            "log_problems": len(problems),
        },
        ok,
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=list(SIZES),
        metavar="SEQS/WAITING,...",
        help="the servers' max_num_seqs/max_waiting (default: 4/64,16/8,2/2)",
    )
    parser.add_argument("--answer-within", type=float, default=30.0, metavar="SECONDS")
    parser.add_argument(
        "--last-answer-max",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="a round fails if its last answer came later than this (default: 5)",
    )
    args = parser.parse_args(argv)
    raise_fd_limit()
    results = [run_size(args, seqs, waiting) for seqs, waiting in args.sizes]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
