"""Disconnect storm: clients that leave at every moment of an exchange.

Each round starts ``--clients`` clients at once against ``--max-num-seqs 8 --max-waiting
32`` (so some run, some wait, some are refused) and each leaves at a random point: halfway
through its request body, right after sending it, after the response head, after some
stream frames, or by a reset (``SO_LINGER`` 0) mid-stream; streaming and non-streaming
alike. Once everyone has gone the server must hold nothing: no request admitted and
neither finished nor aborted, no queue or batch slot, no KV block, no stream writer.
Prints cases, what the server counted (admitted, finished, aborted, refused), what it
still holds, RSS before/after and log problems.

    python scripts/stress/disconnect.py                  # 4 rounds of 250 clients
    python scripts/stress/disconnect.py --rounds 10 --clients 500

Only 127.0.0.1; every client is bounded (5 s), every round too.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import socket
import struct
import sys
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # benchkit

from benchkit import get_stats, model_entry  # noqa: E402
from common import (  # noqa: E402
    MODEL,
    chat_request,
    leaks,
    log_problems,
    raise_fd_limit,
    report,
    rss_mb,
    server,
    settle,
)

WAYS = ("mid_body", "after_send", "after_head", "mid_stream", "reset")


async def client(port: int, way: str, stream_it: bool, rng: random.Random) -> None:
    request = chat_request(rng.choice((5, 50, 2000)), stream=stream_it)
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError:
        return
    try:
        with trio.move_on_after(5):
            if way == "mid_body":
                await stream.send_all(request[: len(request) - 10])
                await trio.sleep(rng.random() * 0.05)
                return
            await stream.send_all(request)
            if way == "after_send":
                await trio.sleep(rng.random() * 0.05)
                return
            data = b""
            while b"\r\n\r\n" not in data and (chunk := await stream.receive_some(65536)):
                data += chunk
            if way == "after_head":
                return
            for _ in range(rng.randint(1, 5)):
                if not await stream.receive_some(65536):
                    break
            if way == "reset":
                stream.socket.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
    except (trio.BrokenResourceError, OSError):
        pass
    finally:
        stream.socket.close()


async def storm(url: str, port: int, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    tried: collections.Counter[str] = collections.Counter()
    before = model_entry(await get_stats(url), MODEL)
    held_per_round = []
    for _ in range(args.rounds):
        async with trio.open_nursery() as nursery:
            for _ in range(args.clients):
                way = rng.choice(WAYS)
                tried[way] += 1
                nursery.start_soon(client, port, way, rng.random() < 0.7, rng)
        with trio.move_on_after(15):
            await settle(url)
        held_per_round.append(await leaks(url))
    after = model_entry(await get_stats(url), MODEL)
    counted = {k: after[k] - before[k] for k in ("admitted", "finished", "aborted", "refused")}
    return {"tried": dict(tried), "counted": counted, "held": held_per_round}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=250)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    raise_fd_limit()
    with server(["--max-num-seqs", "8", "--max-waiting", "32"]) as srv:
        rss_before = rss_mb(srv.pid)
        result = trio.run(storm, srv.url, srv.port, args)
        rss_after = rss_mb(srv.pid)
        code = srv.stop()
        problems = log_problems(srv.log_text())
    print(json.dumps(result), file=sys.stderr)
    leaked = [sum(h.values()) for h in result["held"]]
    counted = result["counted"]
    ok = not any(leaked) and not problems and code == 0
    ok = ok and counted["admitted"] == counted["finished"] + counted["aborted"]
    report(
        "disconnect",
        {
            "clients": args.clients * args.rounds,
            "ways": result["tried"],
            **counted,
            "leaked_per_round": leaked,
            "rss_mb_before_after": [round(rss_before, 1), round(rss_after, 1)],
            "log_problems": len(problems),
            "exit_code": code,
        },
        ok,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
