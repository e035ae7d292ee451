"""What each of the transport's hooks buys: the cost of a unit, the hook on against off.

Each workload runs the serve app's transport in-process -- hypercorn's connection server
as the transport hooks it (``inference_lab/serve/transport``), over a local socket pair,
with a client in the same trio loop -- once with every hook on and once per hook with
that hook off. A figure is what one unit costs the whole process (server and client):

- **request**: a keep-alive request answered the way a completion route answers a
  refusal (the arrival stamp, the close watch, the body read, one whole reply);
- **stream**: a keep-alive request answered the way a one-token stream is (the same,
  then a stream's response start, one mid-stream chunk, and the last chunk with the end
  of the body in one write);
- **write**: a stream's mid-stream write of one SSE frame, the writer passing through
  the scheduler after each (as a stream does, waiting for its next token);
- **token**: a mid-stream token handed to one of 24 streams parked for frames, the way
  the engine task hands tokens over (``StreamSink.on_tokens``);
- **connection**: a connection carrying one request (``Connection: close``).

The hooks (``docs/internals.md``, "The transport"): ``idle_timer`` (hypercorn's
``TrioSingleTask`` when off), ``nowait`` (every write under hypercorn's send lock through
trio's ``send_all`` when off), ``one_write`` (one socket write per protocol event when
off), ``close_watch`` (a task per request waiting for ``http.disconnect`` when off),
``chunk_writer`` (body messages through hypercorn and h11 when off), ``handover`` (the
engine's hand-over wakes the stream's writer when off), ``unlink``, and ``stamp`` (the
arrival stamp: fidelity, kept whatever it costs; off, reads are plain reads).

Instructions are counted by valgrind (``cachegrind``, no cache simulation): the same
whatever else the machine runs. Each (workload, hook) pair is run for ``N`` and ``3N``
units and the difference divided by ``2N`` is the cost of one unit (the start-up cancels
out). ``--cpu`` measures CPU time (``time.process_time``) in-process instead, best of
``--repeats``, for a machine without valgrind (noisy where other work shares the CPU).
Two figures are not costs and are measured without valgrind: the objects a connection
leaves to the cycle collector with ``unlink`` on and off, and how long before the app is
called the arrival stamp puts a request's arrival (and hypercorn's own parse time), for
requests to an idle server over TCP on 127.0.0.1.

    python scripts/bench_transport.py
    python scripts/bench_transport.py --units 300 --jobs 2
    python scripts/bench_transport.py --cpu --units 3000 --only request

Only 127.0.0.1 is contacted (the stamp's figure); everything else stays in the process.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import trio
import trio.testing

REQUEST = b"POST /v1/x HTTP/1.1\r\nhost: localhost\r\ncontent-length: 2\r\n\r\n{}"
CLOSING = (
    b"POST /v1/x HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}"
)
BODY = b'{"id":"cmpl-0123456789abcdef","object":"text_completion","choices":[]}'
REPLY_HEADERS = [
    (b"content-type", b"application/json"),
    (b"content-length", b"%d" % len(BODY)),
    (b"x-request-id", b"cmpl-0123456789abcdef0123456789abcdef"),
]
STREAM_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-request-id", b"cmpl-0123456789abcdef0123456789abcdef"),
]
DONE = b"data: [DONE]\n\n"
FRAME = (
    b'data: {"id":"cmpl-0123456789abcdef","object":"text_completion","created":1764500000,'
    b'"model":"gpt-oss-20b","choices":[{"text":"word ","index":0}]}\n\n'
)
STREAMS = 24


# ---------------------------------------------------------------- switching a hook off
def _off_idle_timer() -> None:
    from hypercorn.trio.worker_context import TrioSingleTask

    from inference_lab.serve.transport import connection

    plain_init = connection.LabTCPServer.__init__

    def init(self: Any, *args: Any) -> None:
        plain_init(self, *args)
        self.idle_task = TrioSingleTask()

    connection.LabTCPServer.__init__ = init  # type: ignore[method-assign]


def _off_nowait() -> None:
    from hypercorn.trio.tcp_server import TCPServer

    from inference_lab.serve.transport import connection

    async def write(self: Any, event: Any, shielded: bool = False) -> None:
        with trio.CancelScope(shield=shielded):
            await TCPServer.protocol_send(self, event)

    connection.LabTCPServer._write = write  # type: ignore[method-assign]


def _off_one_write() -> None:
    from inference_lab.serve.transport import connection

    async def enter(self: Any) -> None:
        pass

    connection.OneWrite.__aenter__ = enter  # type: ignore[method-assign]


def _off_unlink() -> None:
    from inference_lab.serve.transport import connection

    connection.LabTCPServer._unlink = lambda self: None  # type: ignore[method-assign]


def _off_stamp() -> None:
    from inference_lab.serve.transport import receipt

    receipt.enable_receive_timestamps = lambda sock: False  # type: ignore[attr-defined]
    receipt.ReceiptStream.note_waiting = lambda self: None  # type: ignore[method-assign]


def _off_in_the_workload() -> None:
    pass  # the workload itself asks (``off``)


OFF: dict[str, Callable[[], None]] = {
    "idle_timer": _off_idle_timer,
    "nowait": _off_nowait,
    "one_write": _off_one_write,
    "unlink": _off_unlink,
    "stamp": _off_stamp,
    "close_watch": _off_in_the_workload,
    "chunk_writer": _off_in_the_workload,
    "handover": _off_in_the_workload,
}

#: workload -> the hooks it measures (each against every hook on).
PLAN: dict[str, tuple[str, ...]] = {
    "request": ("idle_timer", "nowait", "one_write", "close_watch", "stamp"),
    "stream": ("idle_timer", "nowait", "one_write", "close_watch", "chunk_writer"),
    "write": ("chunk_writer", "nowait"),
    "token": ("handover", "chunk_writer"),
    "connection": ("unlink", "stamp"),
}
UNIT = {
    "request": "keep-alive request",
    "stream": "keep-alive one-token stream",
    "write": "mid-stream write",
    "token": f"token handed to one of {STREAMS} parked streams",
    "connection": "connection (one request)",
}
#: Units per counted unit of a workload (a token round hands one to every stream).
PER_UNIT = {"token": STREAMS}


# ---------------------------------------------------------------- the workloads
def _app(off: str, stream: bool = False) -> Callable[..., Awaitable[None]]:
    """A completion route's shape: the arrival stamp, the close watch (or a task waiting
    for ``http.disconnect``), the body, then one whole reply or a one-token stream."""
    from inference_lab.serve import transport

    async def watch(receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        transport.received_at(send)
        while (await receive()).get("more_body"):
            pass
        answer = _stream if stream else _reply
        closes = None if off == "close_watch" else transport.close_watch(send)
        if closes is not None:
            closes.watch_close(lambda: None)
            try:
                await answer(send, off)
            finally:
                closes.unwatch_close()
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, receive)
            try:
                await answer(send, off)
            finally:
                nursery.cancel_scope.cancel()

    return app


async def _reply(send: Any, off: str = "none") -> None:
    from inference_lab.serve import transport

    async with transport.one_write(send):
        await send({"type": "http.response.start", "status": 200, "headers": REPLY_HEADERS})
        await send({"type": "http.response.body", "body": BODY, "more_body": False})


async def _stream(send: Any, off: str) -> None:
    from inference_lab.serve import transport

    await send({"type": "http.response.start", "status": 200, "headers": STREAM_HEADERS})
    chunks = None if off == "chunk_writer" else transport.chunk_writer(send)

    async def frame() -> None:
        if chunks is None:
            await send({"type": "http.response.body", "body": FRAME, "more_body": True})
        else:
            await chunks(FRAME)

    await frame()
    async with transport.one_write(send):  # the last frame with the end of the body
        await frame()
        await send({"type": "http.response.body", "body": DONE, "more_body": False})


def _config() -> Any:
    from hypercorn.config import Config

    config = Config()
    config.accesslog = None
    config.keep_alive_max_requests = 1 << 30
    return config


async def _read_until(client: trio.SocketStream, end: bytes) -> None:
    data = bytearray()
    while not data.endswith(end):
        chunk = await client.receive_some(1 << 20)
        if not chunk:
            raise RuntimeError("the server closed the connection")
        data += chunk


async def request(units: int, off: str) -> None:
    from inference_lab.serve.transport import local_connection

    server, client = local_connection(_app(off), _config())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.run)
        for _ in range(units):
            await client.send_all(REQUEST)
            await _read_until(client, BODY)
        await client.aclose()


async def stream(units: int, off: str) -> None:
    from inference_lab.serve.transport import local_connection

    server, client = local_connection(_app(off, stream=True), _config())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.run)
        for _ in range(units):
            await client.send_all(REQUEST)
            await _read_until(client, b"0\r\n\r\n")
        await client.aclose()


async def connection(units: int, off: str) -> None:
    from inference_lab.serve.transport import local_connection

    app, config = _app(off), _config()
    for _ in range(units):
        server, client = local_connection(app, config)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.run)
            await client.send_all(CLOSING)
            while await client.receive_some(1 << 20):
                pass
            await client.aclose()


async def write(units: int, off: str) -> None:
    from inference_lab.serve.transport import chunk_writer, local_connection

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        chunks = None if off == "chunk_writer" else chunk_writer(send)
        for _ in range(units):
            if chunks is None:
                await send({"type": "http.response.body", "body": FRAME, "more_body": True})
            else:
                await chunks(FRAME)
            await trio.lowlevel.checkpoint()  # as a stream waits for its next token
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    server, client = local_connection(app, _config())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.run)
        await client.send_all(REQUEST)
        await _read_until(client, b"0\r\n\r\n")
        await client.aclose()


async def token(units: int, off: str) -> None:
    from benchkit import parked_stream_tokens

    from inference_lab.serve import streaming

    if off == "chunk_writer":
        streaming.chunk_writer = lambda send: None  # type: ignore[assignment]
    delivery = streaming.Delivery()
    delivery.direct = off != "handover"
    await parked_stream_tokens(STREAMS, units, delivery, _config(), REQUEST)


WORKLOADS: dict[str, Callable[[int, str], Awaitable[None]]] = {
    "request": request,
    "stream": stream,
    "write": write,
    "token": token,
    "connection": connection,
}


def _child(workload: str, off: str, units: int) -> float:
    """Run ``workload`` for ``units`` with hook ``off`` switched off ("none": every hook
    on), as a server process runs (the heap frozen, the collector's thresholds raised);
    the CPU seconds the units took."""
    from inference_lab.serve.app import GC_THRESHOLDS

    if off != "none":
        OFF[off]()
    trio.run(WORKLOADS[workload], 20, off)  # every path run once
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    start = time.process_time()
    trio.run(WORKLOADS[workload], units, off)
    return time.process_time() - start


# ---------------------------------------------------------------- not costs
def cyclic_garbage(connections: int, off: str) -> float:
    """Objects per connection that only the cycle collector would free."""
    if off != "none":
        OFF[off]()
    trio.run(connection, 20, "none")
    gc.collect()
    gc.disable()
    try:
        trio.run(connection, connections, "none")
        return gc.collect() / connections
    finally:
        gc.enable()


def stamp_lead(requests: int) -> tuple[float, float]:
    """Medians over ``requests`` to an idle server on 127.0.0.1 (one at a time, each on a
    connection of its own, as ``inference-lab serve`` serves them) of how long before the
    app is called the request arrived by the arrival stamp, and by hypercorn's own parse
    time; seconds."""
    from inference_lab.serve import transport
    from inference_lab.serve.server import bind_socket

    transport.install_connection_hook()
    leads: list[tuple[float, float]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        now, wall = trio.current_time(), time.time()
        parsed = now - (wall - send.__self__.start_time)
        leads.append((now - transport.received_at(send), now - parsed))
        await _reply(send)

    async def main() -> None:
        stop = trio.Event()
        sock = bind_socket("127.0.0.1", 0)
        port = sock.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(
                lambda task_status: transport.serve(
                    app,
                    sock,
                    shutdown_trigger=stop.wait,
                    flush_timeout=1.0,
                    keep_alive_timeout=5.0,
                    backlog=16,
                    task_status=task_status,
                )
            )
            for _ in range(requests + 20):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.send_all(CLOSING)
                while await stream.receive_some(65536):
                    pass
                await stream.aclose()
                await trio.sleep(0.002)  # the server idle when the next one comes
            stop.set()

    trio.run(main)
    stamped = [a for a, _ in leads[20:]]
    parsed = [p for _, p in leads[20:]]
    return statistics.median(stamped), statistics.median(parsed)


# ---------------------------------------------------------------- the parent
_REFS = re.compile(rb"I\s+refs:\s+([\d,]+)")


def _instructions(workload: str, off: str, units: int) -> int:
    command = [
        "valgrind",
        "--tool=cachegrind",
        "--cache-sim=no",
        "--cachegrind-out-file=/dev/null",
        sys.executable,
        __file__,
        "--child",
        workload,
        off,
        str(units),
    ]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(command, capture_output=True, env=env, check=False)
    found = _REFS.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"{workload}/{off}: {done.stderr.decode(errors='replace')[-2000:]}")
    return int(found.group(1).replace(b",", b""))


def _per_unit_instructions(workload: str, off: str, units: int) -> float:
    few, more = _instructions(workload, off, units), _instructions(workload, off, 3 * units)
    return (more - few) / (2 * units)


def _run_child(*args: str) -> str:
    command = [sys.executable, __file__, *args]
    return subprocess.run(command, capture_output=True, check=True, text=True).stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--units", type=int, default=300, help="units per run (N)")
    parser.add_argument("--cpu", action="store_true", help="CPU time instead of instructions")
    parser.add_argument("--repeats", type=int, default=3, help="with --cpu: runs, best taken")
    parser.add_argument("--jobs", type=int, default=1, help="valgrind runs at once")
    parser.add_argument("--only", choices=sorted(PLAN), action="append", help="workloads to run")
    parser.add_argument("--child", nargs=3, metavar=("WORKLOAD", "OFF", "UNITS"), help="internal")
    parser.add_argument("--garbage", nargs=2, metavar=("OFF", "UNITS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        workload, off, units = args.child
        print(_child(workload, off, int(units)))
        return 0
    if args.garbage:
        print(cyclic_garbage(int(args.garbage[1]), args.garbage[0]))
        return 0
    if min(args.units, args.repeats, args.jobs) < 1:
        parser.error("--units, --repeats and --jobs must be at least 1")
    if not args.cpu and shutil.which("valgrind") is None:
        parser.error("valgrind is not installed (apt-get install valgrind), or use --cpu")
    workloads = args.only or list(PLAN)
    pairs = [(w, off) for w in workloads for off in ("none", *PLAN[w])]

    def measure(pair: tuple[str, str]) -> float:
        workload, off = pair
        if args.cpu:
            runs = (
                float(_run_child("--child", workload, off, str(args.units)))
                for _ in "_" * args.repeats
            )
            return min(runs) / args.units
        return _per_unit_instructions(workload, off, args.units)

    with ThreadPoolExecutor(max_workers=1 if args.cpu else args.jobs) as pool:
        figures = dict(zip(pairs, pool.map(measure, pairs), strict=True))
    what = "us of CPU" if args.cpu else "instructions"
    scale = 1e6 if args.cpu else 1.0
    for workload in workloads:
        per = PER_UNIT.get(workload, 1)
        base = figures[workload, "none"] / per
        print(f"per {UNIT[workload]}: {base * scale:,.1f} {what} with every hook on")
        for off in PLAN[workload]:
            value = figures[workload, off] / per
            print(
                f"  {off} off: {value * scale:,.1f} ({(value - base) * scale:+,.1f}, "
                f"{(value - base) / base:+.1%})"
            )
    if "connection" in workloads:
        kept, left = (float(_run_child("--garbage", off, "500")) for off in ("none", "unlink"))
        print(
            f"objects a connection leaves to the cycle collector: {kept:.2f} "
            f"(unlink off: {left:.2f})"
        )
    if "request" in workloads:
        stamped, parsed = stamp_lead(200)
        print(
            f"arrival before the app is called (median of 200 lone requests on 127.0.0.1): "
            f"{stamped * 1e6:.0f} us by the arrival stamp, {parsed * 1e6:.0f} us by "
            f"hypercorn's parse time"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
