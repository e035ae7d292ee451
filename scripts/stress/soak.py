"""Soak: the server at saturation for ``--seconds``, its memory and open files sampled.

``--clients`` closed-loop clients (default 100) against ``--max-num-seqs 32 --max-waiting
64``: the batch is always full, the waiting queue at its bound, and the clients beyond it
get 529s (and try again 50 ms later). Each client sends a streaming chat request for 16 to
128 tokens and reads it to ``[DONE]``; one request in 20 is non-streaming, one in 50
leaves mid-stream, one in 50 is invalid JSON (a 400 is expected). Every
``--sample-every`` seconds the server's RSS (``VmRSS``), open file descriptors and
progress are printed. At the end: requests, errors (a 5xx, an unexpected status, a stream
cut short), what the server still holds once the clients stop, and RSS / fds first, last
and highest.

    python scripts/stress/soak.py                         # 30 s
    python scripts/stress/soak.py --seconds 1200          # the 20-minute soak

Only 127.0.0.1; bounded by ``--seconds`` (plus startup and a 15 s settle).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # benchkit

from common import (  # noqa: E402
    CHAT,
    chat_request,
    exchange,
    leaks,
    log_problems,
    open_fds,
    post,
    raise_fd_limit,
    read_response,
    report,
    rss_mb,
    server,
    settle,
)


class Load:
    def __init__(self, port: int, seed: int) -> None:
        self.port = port
        self.rng = random.Random(seed)
        self.statuses: collections.Counter[int] = collections.Counter()
        self.errors: list[str] = []
        self.done = 0

    async def one(self) -> None:
        roll = self.rng.random()
        tokens = self.rng.randint(16, 128)
        data = bytearray()
        if roll < 0.02:  # invalid JSON: a 400
            with trio.move_on_after(30):
                await exchange(self.port, post(CHAT, b"{nope"), data)
            expect: tuple[int, ...] = (400,)
        elif roll < 0.04:  # leaves mid-stream
            with trio.move_on_after(self.rng.random() * 0.5):
                await exchange(self.port, chat_request(tokens), data)
            self.done += 1
            return
        else:
            stream = roll >= 0.09
            with trio.move_on_after(60):
                await exchange(self.port, chat_request(tokens, stream=stream), data)
            expect = (200, 529)
        response = read_response(bytes(data))
        self.statuses[response.status] += 1
        self.done += 1
        if response.status not in expect:
            self.errors.append(f"HTTP {response.status}: {bytes(data[:200])!r}")
        elif response.status == 200 and (
            not response.complete or (b"data: " in response.body and b"[DONE]" not in response.body)
        ):
            self.errors.append(f"incomplete 200: {bytes(data[-200:])!r}")
        if response.status == 529:
            await trio.sleep(0.05)

    async def client(self) -> None:
        while True:
            await self.one()


async def soak(url: str, port: int, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    load = Load(port, args.seed)
    samples: list[dict[str, Any]] = []
    start = time.monotonic()

    def sample() -> None:
        row = {
            "t": round(time.monotonic() - start),
            "rss_mb": round(rss_mb(pid), 1),
            "fds": open_fds(pid),
            "requests": load.done,
            "errors": len(load.errors),
        }
        samples.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)

    sample()
    async with trio.open_nursery() as nursery:
        for _ in range(args.clients):
            nursery.start_soon(load.client)
        with trio.move_on_after(args.seconds):
            while True:
                await trio.sleep(args.sample_every)
                sample()
        nursery.cancel_scope.cancel()
    with trio.move_on_after(15):
        await settle(url)
    held = await leaks(url)
    sample()
    return {"samples": samples, "load": load, "held": held}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--sample-every", type=float, default=10.0, metavar="SECONDS")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the samples here")
    args = parser.parse_args(argv)
    raise_fd_limit()
    with server(["--max-num-seqs", "32", "--max-waiting", "64"]) as srv:
        result = trio.run(soak, srv.url, srv.port, srv.pid, args)
        code = srv.stop()
        problems = log_problems(srv.log_text())
    load: Load = result["load"]
    samples = result["samples"]
    for line in load.errors[:10]:
        print("  error:", line, file=sys.stderr)
    rss = [s["rss_mb"] for s in samples]
    fds = [s["fds"] for s in samples]
    figures = {
        "seconds": args.seconds,
        "clients": args.clients,
        "requests": load.done,
        "statuses": dict(sorted(load.statuses.items())),
        "errors": len(load.errors),
        "leaked": sum(result["held"].values()),
        "rss_mb_first_last_max": [rss[0], rss[-1], max(rss)],
        "fds_first_last_max": [fds[0], fds[-1], max(fds)],
        "log_problems": len(problems),
        "exit_code": code,
    }
    if args.json is not None:
        args.json.write_text(json.dumps({**figures, "samples": samples}, indent=1) + "\n")
    ok = not load.errors and not figures["leaked"] and not problems and code == 0
    ok = ok and not any(500 <= status != 529 for status in load.statuses)
    report("soak", figures, ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
