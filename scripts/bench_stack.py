"""What the HTTP stack costs per write and per request, in-process.

Runs the serve app's transport (hypercorn's connection server as the transport hooks it,
``transport.local_connection``) over a local socket pair with a minimal ASGI app — no engine, no pacing — and a reader in the same
trio loop, and prints the CPU time (``time.process_time``) per unit:

- **per write**: one streaming response writing N mid-stream chunks of one SSE frame
  each, the way a stream writes them (pre-framed, straight to the connection:
  ``chunk_writer``) and, for comparison, as ASGI body messages through hypercorn's
  request stream and h11 (what any other app's writes take) — the framing, the send
  lock and the ``send`` system call, plus the reader's share;
- **per request**: N requests on one keep-alive connection, each answered by a response
  start and one body message (the path of a one-token answer) — h11 parsing, the request
  stream's set-up, the app task, the response start, the body and its end, the idle timer;
- **per token handed over**: S streams (``--streams``, 24) served by the serve app's
  stream writer (``write_stream``), each parked for frames, and a loop that hands every
  stream one mid-stream token per round the way the engine task does
  (``StreamSink.on_tokens``) — with the hand-over writing the token itself (streaming
  Rule 7, as served) and, as the baseline of the same run, with it waking each stream's
  writer to write it (``Delivery.direct`` off);
- **per request after a pause**: the same keep-alive request, each timed on its own
  (median), sent back to back and after a pause of 0.1, 2 and 10 ms spent asleep (the
  loop idle in its I/O wait, as a server between requests) or spinning (the process on
  the CPU all along): how much dearer the same code runs when it has not run for a
  while, on this machine (its caches, shared with other work, have been refilled).

    python scripts/bench_stack.py
    python scripts/bench_stack.py --writes 50000 --requests 5000 --rounds 5000 --paused 1000

Nothing listens; no traffic leaves the process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import trio
from benchkit import parked_stream_tokens
from hypercorn.config import Config as HyperConfig

from inference_lab.serve.streaming import Delivery
from inference_lab.serve.transport import chunk_writer, local_connection

FRAME = (
    b'data: {"id":"cmpl-0123456789abcdef","object":"text_completion","created":1764500000,'
    b'"model":"gpt-oss-20b","choices":[{"text":"word ","index":0}]}\n\n'
)
REQUEST = b"GET /x HTTP/1.1\r\nhost: localhost\r\n\r\n"
#: Seconds between requests for ``per_request_after``.
PAUSES = (0.0001, 0.002, 0.01)


async def _serve(app: Any, work: Any) -> None:
    config = HyperConfig()
    config.accesslog = None
    config.keep_alive_max_requests = 1 << 30
    server, client = local_connection(app, config)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.run)
        await work(client)
        await client.aclose()


async def per_write(writes: int, through_send: bool = False) -> float:
    """CPU seconds per mid-stream write: pre-framed (a stream's way), or as body messages
    through hypercorn (``through_send``)."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        write = None if through_send else chunk_writer(send)
        for _ in range(writes):
            if write is None:
                await send({"type": "http.response.body", "body": FRAME, "more_body": True})
            else:
                await write(FRAME)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    spent = 0.0

    async def work(client: trio.SocketStream) -> None:
        nonlocal spent
        start = time.process_time()
        await client.send_all(REQUEST)
        data = bytearray()
        while not data.endswith(b"0\r\n\r\n"):
            data += await client.receive_some(1 << 20)
        spent = time.process_time() - start

    await _serve(app, work)
    return spent / writes


async def _one_body_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers every request with a start and one body message."""
    if scope["type"] != "http":
        return
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", b"%d" % len(FRAME))],
        }
    )
    await send({"type": "http.response.body", "body": FRAME, "more_body": False})


async def _request(client: trio.SocketStream) -> None:
    await client.send_all(REQUEST)
    data = bytearray()
    while not data.endswith(FRAME):
        data += await client.receive_some(65536)


async def per_request(requests: int) -> float:
    """CPU seconds per request answered with a start and one body message."""
    spent = 0.0

    async def work(client: trio.SocketStream) -> None:
        nonlocal spent
        start = time.process_time()
        for _ in range(requests):
            await _request(client)
        spent = time.process_time() - start

    await _serve(_one_body_app, work)
    return spent / requests


async def per_request_after(requests: int, pause: float, spin: bool) -> float:
    """Median CPU seconds of one such request, each timed on its own, sent ``pause``
    seconds after the previous one ended: asleep (trio's I/O wait) or spinning."""
    spent: list[float] = []

    async def work(client: trio.SocketStream) -> None:
        for _ in range(requests):
            if spin:
                end = time.perf_counter() + pause
                while time.perf_counter() < end:
                    pass
            elif pause:
                await trio.sleep(pause)
            start = time.process_time()
            await _request(client)
            spent.append(time.process_time() - start)

    await _serve(_one_body_app, work)
    return statistics.median(spent)


async def per_token(streams: int, rounds: int, direct: bool) -> float:
    """CPU seconds per mid-stream token handed to a parked stream writer (``direct``:
    written by the hand-over itself; else by the writer it wakes)."""
    delivery = Delivery()
    delivery.direct = direct
    config = HyperConfig()
    config.accesslog = None
    spent = await parked_stream_tokens(streams, rounds, delivery, config, REQUEST)
    return spent / (rounds * streams)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writes", type=int, default=20_000)
    parser.add_argument("--requests", type=int, default=2_000)
    parser.add_argument("--streams", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2_000)
    parser.add_argument("--paused", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    counts = (args.writes, args.requests, args.streams, args.rounds, args.paused, args.repeats)
    if min(counts) < 1:
        parser.error(
            "--writes, --requests, --streams, --rounds, --paused and --repeats must be at least 1"
        )
    writes = [trio.run(per_write, args.writes) for _ in range(args.repeats)]
    sends = [trio.run(per_write, args.writes, True) for _ in range(args.repeats)]
    requests = [trio.run(per_request, args.requests) for _ in range(args.repeats)]
    handed: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeats):  # interleaved, so both see the same machine
        for direct in (False, True):
            handed[direct].append(trio.run(per_token, args.streams, args.rounds, direct))
    back_to_back = trio.run(per_request_after, args.paused, 0.0, False)
    paused = {
        (pause, spin): trio.run(per_request_after, args.paused, pause, spin)
        for spin in (False, True)
        for pause in PAUSES
    }
    print(
        f"per mid-stream write: {min(writes) * 1e6:.1f} us of CPU (best of {args.repeats}; "
        f"all {', '.join(f'{w * 1e6:.1f}' for w in writes)})"
    )
    print(
        f"  the same as body messages through hypercorn and h11: {min(sends) * 1e6:.1f} us "
        f"(all {', '.join(f'{w * 1e6:.1f}' for w in sends)})"
    )
    print(
        f"per request (start + one body, keep-alive): {min(requests) * 1e6:.1f} us of CPU "
        f"(best of {args.repeats}; all {', '.join(f'{r * 1e6:.1f}' for r in requests)})"
    )
    woken, written = min(handed[False]), min(handed[True])
    print(
        f"per token handed to {args.streams} parked streams: {written * 1e6:.1f} us of CPU "
        f"written by the hand-over (all {', '.join(f'{t * 1e6:.1f}' for t in handed[True])}); "
        f"{woken * 1e6:.1f} us waking the writer (all "
        f"{', '.join(f'{t * 1e6:.1f}' for t in handed[False])}): x{written / woken:.2f}"
    )
    print(
        f"per request timed on its own (median of {args.paused}): "
        f"{back_to_back * 1e6:.0f} us of CPU back to back"
    )
    for spin, how in ((False, "asleep"), (True, "spinning")):
        after = [paused[pause, spin] for pause in PAUSES]
        print(
            f"  after a pause {how}: "
            + " / ".join(f"{a * 1e6:.0f}" for a in after)
            + f" us after {' / '.join(f'{p * 1e3:g}' for p in PAUSES)} ms "
            + "("
            + " / ".join(f"x{a / back_to_back:.1f}" for a in after)
            + ")"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
