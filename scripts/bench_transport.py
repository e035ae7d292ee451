"""What each of the transport's hooks buys: CPU instructions per unit, the hook on vs off.

Each workload runs the serve app's transport in-process -- hypercorn's connection server
as the transport hooks it, over a local socket pair, with a client in the same trio loop
-- once with every hook on and once with one hook off. A figure is what one unit costs
the whole process (server and client): a keep-alive request, a connection, a mid-stream
write, a token handed to a parked stream.

Instructions are counted by valgrind (``cachegrind``, no cache simulation): the same
whatever else the machine runs. Each (workload, hook) pair is run for ``N`` and ``3N``
units, and the difference divided by ``2N`` is the cost of one unit (the start-up cancels
out). ``--cpu`` measures CPU time (``time.process_time``) in-process instead, best of
``--repeats``, for a machine without valgrind (noisy where other work shares the CPU).

    python scripts/bench_transport.py
    python scripts/bench_transport.py --units 400 --jobs 2
    python scripts/bench_transport.py --cpu --units 3000

Nothing listens; no traffic leaves the process.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import trio

#: Request of the keep-alive and connection workloads.
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


def _off_untimed_read() -> None:
    from hypercorn.trio.tcp_server import TCPServer

    from inference_lab.serve.transport import connection

    async def read(self: Any) -> None:
        await TCPServer._read_data(self)

    connection.LabTCPServer._read_untimed = read  # type: ignore[method-assign]


def _off_plain_run() -> None:
    from hypercorn.trio.tcp_server import TCPServer

    from inference_lab.serve.transport import connection

    async def run(self: Any) -> None:
        await TCPServer.run(self)

    connection.LabTCPServer._run_plain = run  # type: ignore[method-assign]


def _off_h11_short() -> None:
    from inference_lab.serve.transport import connection

    connection.adopt = lambda protocol: None


def _off_unlink() -> None:
    from inference_lab.serve.transport import connection

    connection.LabTCPServer._unlink = lambda self: None  # type: ignore[method-assign]


def _off_one_write() -> None:
    from inference_lab.serve.transport import connection

    async def enter(self: Any) -> None:
        pass

    connection.OneWrite.__aenter__ = enter  # type: ignore[method-assign]


def _off_listener_stamps() -> None:
    pass  # the connection workload's configuration says so


def _off_stamp() -> None:
    from inference_lab.serve.transport import connection

    plain_init = connection.ReceiptStream.__init__

    def init(self: Any, stream: Any, *, stamped: bool = False) -> None:
        plain_init(self, stream, stamped=True)  # asks nothing
        self.stamped = False

    connection.ReceiptStream.__init__ = init  # type: ignore[method-assign]
    connection.ReceiptStream.note_waiting = lambda self: None  # type: ignore[method-assign]


OFF: dict[str, Callable[[], None]] = {
    "idle_timer": _off_idle_timer,
    "nowait": _off_nowait,
    "untimed_read": _off_untimed_read,
    "plain_run": _off_plain_run,
    "h11_short": _off_h11_short,
    "unlink": _off_unlink,
    "one_write": _off_one_write,
    "listener_stamps": _off_listener_stamps,
    "stamp": _off_stamp,
    "close_watch": lambda: None,  # the workloads' app asks
    "chunk_writer": lambda: None,
    "handover": lambda: None,
}

#: workload -> the hooks it measures (each against every hook on).
PLAN: dict[str, tuple[str, ...]] = {
    "request": (
        "idle_timer",
        "nowait",
        "untimed_read",
        "h11_short",
        "one_write",
        "close_watch",
        "stamp",
    ),
    "connection": ("plain_run", "unlink", "listener_stamps", "h11_short"),
    "write": ("chunk_writer", "nowait"),
    "token": ("handover", "chunk_writer", "nowait"),
}
UNIT = {
    "request": "keep-alive request",
    "connection": "connection (one request)",
    "write": "mid-stream write",
    "token": f"token handed to {STREAMS} parked streams",
}
#: Tokens per unit of a workload (a token round hands one to every stream).
PER_UNIT = {"token": STREAMS}


# ---------------------------------------------------------------- the workloads
def _app(off: str) -> Callable[..., Awaitable[None]]:
    """A completion route's shape: the arrival stamp, the close watch (or a task waiting
    for ``http.disconnect``), the body, one whole reply."""
    from inference_lab.serve.transport import connection

    async def watch(receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        connection.received_at(send)
        while (await receive()).get("more_body"):
            pass
        server = None if off == "close_watch" else connection.connection_server(send)
        if server is not None:
            server.watch_close(lambda: None)
            try:
                await _reply(send)
            finally:
                server.unwatch_close()
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, receive)
            try:
                await _reply(send)
            finally:
                nursery.cancel_scope.cancel()

    return app


async def _reply(send: Any) -> None:
    from inference_lab.serve.transport import connection

    async with connection.one_write(send):
        await send({"type": "http.response.start", "status": 200, "headers": REPLY_HEADERS})
        await send({"type": "http.response.body", "body": BODY, "more_body": False})


def _config(off: str) -> Any:
    from inference_lab.serve.transport.connection import LabConfig

    config = LabConfig()
    config.accesslog = None
    config.keep_alive_max_requests = 1 << 30
    config.listener_stamps = off != "listener_stamps"
    return config


async def _read_until(client: trio.SocketStream, end: bytes) -> None:
    data = bytearray()
    while not data.endswith(end):
        chunk = await client.receive_some(1 << 20)
        if not chunk:
            raise RuntimeError("the server closed the connection")
        data += chunk


async def request(units: int, off: str) -> None:
    from inference_lab.serve.transport.connection import local_connection

    server, client = local_connection(_app(off), _config(off))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.run)
        for _ in range(units):
            await client.send_all(REQUEST)
            await _read_until(client, BODY)
        await client.aclose()


async def connection_(units: int, off: str) -> None:
    from inference_lab.serve.transport.connection import local_connection

    app, config = _app(off), _config(off)
    for _ in range(units):
        server, client = local_connection(app, config)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.run)
            await client.send_all(CLOSING)
            while await client.receive_some(1 << 20):
                pass
            await client.aclose()


async def write(units: int, off: str) -> None:
    from inference_lab.serve.transport.connection import chunk_writer, local_connection

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
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    server, client = local_connection(app, _config(off))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.run)
        await client.send_all(REQUEST)
        await _read_until(client, b"0\r\n\r\n")
        await client.aclose()


async def token(units: int, off: str) -> None:
    from inference_lab.api.openai import StreamEncoder, parse_completion_request
    from inference_lab.serve import streaming
    from inference_lab.serve.streaming import Delivery, StreamSink, write_stream
    from inference_lab.serve.transport.connection import local_connection

    if off == "chunk_writer":
        streaming.chunk_writer = lambda send: None  # type: ignore[assignment]
    delivery = Delivery()
    delivery.direct = off != "handover"
    body = {"model": "m", "prompt": "x", "max_tokens": 1 << 30, "stream": True}
    parsed = parse_completion_request(body, 16)
    sinks: list[StreamSink] = []
    parked = trio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        sink = StreamSink(StreamEncoder(parsed, request_id="cmpl-bench", created=0))
        sink.last = 1 << 30  # every token is mid-stream
        sinks.append(sink)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if len(sinks) == STREAMS:
            parked.set()
        await write_stream(send, sink, delivery)

    async def drain(client: trio.SocketStream) -> None:
        with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
            while await client.receive_some(1 << 20):
                pass

    config = _config(off)
    async with trio.open_nursery() as nursery:
        for _ in range(STREAMS):
            server, client = local_connection(app, config)
            nursery.start_soon(server.run)
            await client.send_all(REQUEST)
            nursery.start_soon(drain, client)
        await parked.wait()
        for _ in range(50):  # every writer parked for frames
            await trio.testing.wait_all_tasks_blocked()
        for _ in range(units):
            for sink in sinks:
                sink.on_tokens(1)
            for _ in range(3):  # the writers (woken ones) and the readers run
                await trio.lowlevel.checkpoint()
        nursery.cancel_scope.cancel()


WORKLOADS: dict[str, Callable[[int, str], Awaitable[None]]] = {
    "request": request,
    "connection": connection_,
    "write": write,
    "token": token,
}


def _child(workload: str, off: str, units: int) -> float:
    """Run ``workload`` for ``units`` with hook ``off`` switched off ("none": every hook
    on); the CPU seconds the units took."""
    import trio.testing  # noqa: F401 - (wait_all_tasks_blocked)

    if off != "none":
        OFF[off]()
    trio.run(WORKLOADS[workload], 20, off)  # warm every path once
    gc.collect()
    gc.freeze()  # as a server process does (serve/app.py)
    gc.set_threshold(50_000, 20, 20)
    start = time.process_time()
    trio.run(WORKLOADS[workload], units, off)
    return time.process_time() - start


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
    return (_instructions(workload, off, 3 * units) - _instructions(workload, off, units)) / (
        2 * units
    )


def _per_unit_cpu(workload: str, off: str, units: int) -> float:
    command = [sys.executable, __file__, "--child", workload, off, str(units)]
    done = subprocess.run(command, capture_output=True, check=True, text=True)
    return float(done.stdout) / units


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--units", type=int, default=300, help="units per run (N)")
    parser.add_argument("--cpu", action="store_true", help="CPU time instead of instructions")
    parser.add_argument("--repeats", type=int, default=3, help="with --cpu: runs, best taken")
    parser.add_argument("--jobs", type=int, default=1, help="valgrind runs at once")
    parser.add_argument("--only", choices=sorted(PLAN), action="append", help="workloads to run")
    parser.add_argument("--child", nargs=3, metavar=("WORKLOAD", "OFF", "UNITS"), help="internal")
    args = parser.parse_args()
    if args.child:
        workload, off, units = args.child
        print(_child(workload, off, int(units)))
        return 0
    if min(args.units, args.repeats, args.jobs) < 1:
        parser.error("--units, --repeats and --jobs must be at least 1")
    if not args.cpu and shutil.which("valgrind") is None:
        parser.error("valgrind is not installed (apt-get install valgrind), or use --cpu")
    pairs = [(w, off) for w in args.only or PLAN for off in ("none", *PLAN[w])]

    def measure(pair: tuple[str, str]) -> float:
        workload, off = pair
        if args.cpu:
            return min(_per_unit_cpu(workload, off, args.units) for _ in range(args.repeats))
        return _per_unit_instructions(workload, off, args.units)

    with ThreadPoolExecutor(max_workers=1 if args.cpu else args.jobs) as pool:
        figures = dict(zip(pairs, pool.map(measure, pairs), strict=True))
    what = "us of CPU" if args.cpu else "instructions"
    scale = 1e6 if args.cpu else 1.0
    for workload in args.only or PLAN:
        for pair in figures:
            if pair[0] == workload:
                figures[pair] /= PER_UNIT.get(workload, 1)
        base = figures[workload, "none"]
        print(f"per {UNIT[workload]}: {base * scale:,.1f} {what} with every hook on")
        for off in PLAN[workload]:
            value = figures[workload, off]
            print(
                f"  {off:16} off: {value * scale:,.1f} ({(value - base) * scale:+,.1f}, "
                f"{(value - base) / base:+.1%}: what the hook saves)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
