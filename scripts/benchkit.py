"""What the benchmarks and experiments in ``scripts/`` share: a server subprocess, JSON over
the load client's own HTTP connection, the control endpoints, the roofline's prediction of
a closed loop, the hypervisor's steal time, and JSON-output helpers.

Rule 1: the server is reached only over HTTP: ``ServerProcess`` starts ``inference-lab
        serve`` as another process and learns its URL from the banner. The only server-side
        code used is the roofline, for predictions (``predict_closed_loop``).
Rule 2: only the given origin is contacted (``ServerProcess`` binds 127.0.0.1), each
        exchange on a fresh connection that is closed afterwards, under a time limit.
Rule 3: ``ServerProcess`` always stops what it started: SIGINT (a graceful shutdown), then
        SIGKILL if the server has not exited within ``STOP_TIMEOUT`` seconds.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from types import TracebackType
from typing import Any

import attrs
import numpy as np
import trio

from inference_lab.client.http import (
    Connect,
    ConnectionFailed,
    ConnectionPool,
    connect_tcp,
    parse_base_url,
)
from inference_lab.core.config import Deployment
from inference_lab.core.roofline import Roofline
from inference_lab.socket_stamps import enable_receive_timestamps, receive_stamped

__all__ = [
    "Result",
    "ServerProcess",
    "blocking_stream",
    "client_loop",
    "completion_request",
    "one_stream",
    "read_response",
    "scrape_loop",
    "columns",
    "get_capacity",
    "get_stats",
    "model_entry",
    "post_capacity",
    "predict_closed_loop",
    "request_json",
    "rounded",
    "machine_steal",
    "parse_steal",
    "steal_pct",
]

#: Seconds the server gets to print its URL, and then to answer ``GET /health``.
STARTUP_TIMEOUT = 20.0
#: Seconds a stopping server gets after SIGINT before it is killed.
STOP_TIMEOUT = 8.0
#: Seconds one ``request_json`` exchange may take.
REQUEST_TIMEOUT = 10.0
_BODY_LIMIT = 16 << 20
_URL = re.compile(r"listening on (http://\S+)")
#: The raw client's prompt: ceil(200 / 4) = 50 prompt tokens on /v1/completions.
PROMPT_BYTES = 200
_TERMINATOR = b"0\r\n\r\n"
_TOKEN = b'"text":"'
_CONTENT_LENGTH = re.compile(rb"(?i)\r\ncontent-length: *(\d+)")
#: Where Linux counts the machine's CPU time (its first line: all processors together).
PROC_STAT = Path("/proc/stat")


def parse_steal(proc_stat: str) -> tuple[int, int] | None:
    """``(stolen, total)`` clock ticks from the text of ``/proc/stat``: its ``cpu`` line's
    ``steal`` (the 8th number: time the hypervisor ran something else while this
    machine's processors had work) and the sum of the first eight (user, nice, system,
    idle, iowait, irq, softirq, steal; the guest times are inside user). None when the
    line is missing or has no steal column."""
    for line in proc_stat.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            try:
                ticks = [int(f) for f in fields[1:9]]
            except ValueError:
                return None
            return (ticks[7], sum(ticks)) if len(ticks) == 8 else None
    return None


def machine_steal() -> tuple[int, int] | None:
    """This machine's steal and total CPU time so far (:func:`parse_steal` of
    ``/proc/stat``), or None where there is none (not Linux) or it cannot be read."""
    try:
        return parse_steal(PROC_STAT.read_text())
    except OSError:
        return None


def steal_pct(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float:
    """The share (%) of the machine's CPU time between two :func:`machine_steal` readings
    that the hypervisor took for other work: a figure above a few per cent says the
    machine was slowed from outside while it was measured. NaN when unknown."""
    if before is None or after is None or after[1] <= before[1]:
        return float("nan")
    return (after[0] - before[0]) / (after[1] - before[1]) * 100


class ServerProcess:
    """``inference-lab serve --host 127.0.0.1 --port 0 ARGS`` in a subprocess (the same
    Python interpreter), healthy on entry and stopped on exit (Rule 3):

        with ServerProcess(["--config", path, "--max-num-seqs", "64"]) as server:
            trio.run(experiment, server.url)

    ``url`` is the server's base URL once entered. The server's stderr goes to ``log``
    (a file) or to ours; its banner is echoed on our stderr. Blocking: enter and stop it
    outside ``trio.run``. ``stop`` is idempotent; callers that cannot use ``with`` call
    ``__enter__`` and ``stop`` themselves. ``command`` names another subcommand that
    serves HTTP the same way (``proxy``: ``--host``, ``--port``, the banner's URL,
    ``GET /health``).
    """

    def __init__(
        self,
        args: list[str],
        *,
        log: Path | None = None,
        cwd: Path | None = None,
        command: str = "serve",
    ):
        self.args = args
        self.log = log
        self.cwd = cwd
        self.command = command
        self.url = ""
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> ServerProcess:
        cmd = [sys.executable, "-m", "inference_lab.cli", self.command, "--host", "127.0.0.1"]
        cmd += ["--port", "0", *self.args]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        log = open(self.log, "w") if self.log is not None else None  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                cmd, cwd=self.cwd, stdout=subprocess.PIPE, stderr=log, text=True, env=env
            )
        finally:
            if log is not None:
                log.close()
        try:
            self.url = self._read_url()
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _read_url(self) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + STARTUP_TIMEOUT
        banner: list[str] = []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            banner.append(line.rstrip())
            match = _URL.search(line)
            if match:
                print("\n".join(banner), file=sys.stderr)
                return match.group(1)
        raise RuntimeError("the server did not start:\n" + "\n".join(banner))

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            try:
                status, _ = trio.run(request_json, self.url, "GET", "/health")
                if status == 200:
                    return
            except ConnectionFailed:
                pass
            time.sleep(0.05)  # polling a process we do not control; nothing to wait on
        raise RuntimeError(f"{self.url}/health did not answer 200 in {STARTUP_TIMEOUT} s")

    def stop(self) -> None:
        """Stop the server (Rule 3); does nothing if it is not running."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


async def request_json(
    url: str, method: str, path: str, body: Any = None, *, connect: Connect = connect_tcp
) -> tuple[int, Any]:
    """One exchange with the server at ``url`` (its origin; ``path`` goes after the URL's
    own path prefix): ``body`` sent as JSON when not None; returns the status and the
    decoded JSON answer (None for an empty body).

    Raises ``ConnectionFailed`` when the exchange fails and ``trio.TooSlowError`` after
    ``REQUEST_TIMEOUT`` seconds (Rule 2)."""
    origin = parse_base_url(url)
    pool = ConnectionPool(origin, connect=connect)
    data = b"" if body is None else json.dumps(body).encode()
    headers = [
        ("host", origin.authority),
        ("content-type", "application/json"),
        ("connection", "close"),
    ]
    with trio.fail_after(REQUEST_TIMEOUT):
        conn = await pool.acquire()
        try:
            await conn.send_request(method, origin.base_path + path, headers, data)
            response = await conn.receive_response()
            raw = await conn.read_body(_BODY_LIMIT)
        finally:
            conn.close()
    return response.status_code, json.loads(raw) if raw else None


async def _control(url: str, method: str, path: str, body: Any = None) -> Any:
    status, answer = await request_json(url, method, path, body)
    if status != 200:
        raise RuntimeError(f"{method} {path}: HTTP {status}: {answer}")
    return answer


async def get_stats(url: str, finished: int | None = None) -> dict[str, Any]:
    """``GET /control/stats``: the process, delivery and per-model (``models``) statistics,
    the simulated E2E median over the ``finished`` latest completions when given;
    RuntimeError unless HTTP 200."""
    query = "" if finished is None else f"?finished={finished}"
    answer: dict[str, Any] = await _control(url, "GET", "/control/stats" + query)
    return answer


async def get_capacity(url: str) -> list[dict[str, Any]]:
    """``GET /control/capacity``: one entry per model; RuntimeError unless HTTP 200."""
    return list(await _control(url, "GET", "/control/capacity"))


async def post_capacity(url: str, **change: Any) -> list[dict[str, Any]]:
    """``POST /control/capacity`` with ``change`` (``model``, ``max_num_seqs``,
    ``max_waiting``); returns the new capacity entries; RuntimeError unless HTTP 200."""
    return list(await _control(url, "POST", "/control/capacity", change))


def model_entry(answer: list[dict[str, Any]] | dict[str, Any], model: str) -> dict[str, Any]:
    """The entry of ``model`` in a ``/control/capacity`` answer (a list of entries) or a
    ``/control/stats`` answer (its ``models`` list); KeyError naming the model if the
    server does not serve it."""
    entries = answer["models"] if isinstance(answer, dict) else answer
    for entry in entries:
        if entry.get("model") == model:
            return entry
    raise KeyError(f"the server does not serve {model!r}")


def columns(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, list[Any]]:
    """Rows (e.g. ``/control/capacity`` snapshots) as one list per key, for compact JSON."""
    return {key: [row[key] for row in rows] for key in keys}


def rounded(value: Any, digits: int = 6) -> Any:
    """``value`` with every float cut to ``digits`` significant digits (JSON outputs)."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v, digits) for v in value]
    return value


def predict_closed_loop(
    dep: Deployment, *, clients: int, seqs: int, prompt: int, output: int
) -> dict[str, Any]:
    """The roofline's steady state for ``clients`` closed-loop clients, each sending a
    ``prompt``-token request for ``output`` tokens as soon as its last one ended, against a
    batch cap ``seqs``. Times in seconds. The experiments compare their measurements with it.

        B        = min(C, S)                                  running requests
        t_dec    = step_time(n = [1]·B, c = [P + L/2]·B)      a decode step, mean context
        t_pf     = step_time(n = [P, 1, …, 1], c = [0, P + L/2, …])   the same step with one
                   request prefilling instead of decoding
        t_step   = t_dec + (B / L)·(t_pf − t_dec)             every request prefills once in
                   its L steps, so a step carries B/L prefills on average
        tokens/s = B / t_step                                 one token per running request
        E2E      = max(1, C / S)·L·t_step                     Little's law: C requests in the
                   system, S/(L·t_step) finishing per second
        TTFT     = E2E − (L − 1)·t_step                       queueing + the prefill step
        TPOT     = t_step                                     inter-token time
    """
    roof = Roofline(dep)
    batch = min(clients, seqs)
    ctx = prompt + output // 2
    ones = np.ones(batch, dtype=np.int64)
    t_dec = roof.step_time(ones, np.full(batch, ctx, dtype=np.int64))
    n = ones.copy()
    n[0] = prompt
    c = np.full(batch, ctx, dtype=np.int64)
    c[0] = 0
    t_pf = roof.step_time(n, c)
    t_step = t_dec + (batch / output) * (t_pf - t_dec)
    e2e = max(1.0, clients / seqs) * output * t_step
    return {
        "batch": batch,
        "t_decode": t_dec,
        "t_step_with_prefill": t_pf,
        "t_step": t_step,
        "output_tokens_per_s": batch / t_step,
        "requests_per_s": batch / (output * t_step),
        "e2e": e2e,
        "ttft": e2e - (output - 1) * t_step,
        "tpot": t_step,
    }


# ---------------------------------------------------------------------------------------
# a raw streaming client (the serve benchmarks')


@attrs.define
class Result:
    start: float
    ttft: float
    e2e: float
    tokens: int
    status: int
    #: (arrival time, tokens in that write) per write that carried tokens
    writes: list[tuple[float, int]] = attrs.field(factory=list)


def completion_request(host: str, model: str, max_tokens: int, stream: bool = True) -> bytes:
    body = json.dumps(
        {
            "model": model,
            "prompt": "x" * PROMPT_BYTES,
            "max_tokens": max_tokens,
            "ignore_eos": True,  # every answer runs to max_tokens (vLLM's field)
            "stream": stream,
        }
    ).encode()
    return (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


class _StreamReader:
    """One streaming completion's answer, fed as its bytes arrive: when its first token
    and its ``[DONE]`` arrived, which writes carried tokens, and when the answer is whole
    (a chunked body's terminator after ``[DONE]``, or, for an answer that is not a
    stream such as a refusal, its ``content-length``)."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.buf = bytearray()
        self.writes: list[tuple[float, int]] = []
        self.ttft = 0.0
        self.done_at = 0.0
        self._body_end: int | None = None  # an answer with a content-length: where it ends

    def feed(self, chunk: bytes, now: float) -> bool:
        """Take ``chunk``, read at ``now``; True once the answer is whole."""
        buf = self.buf
        buf += chunk
        tokens = chunk.count(_TOKEN)
        if tokens:
            self.writes.append((now, tokens))
            if not self.ttft:
                self.ttft = now - self.start
        if not self.done_at and b"[DONE]" in chunk:
            self.done_at = now  # the last token arrives with [DONE]
        if self._body_end is None and not buf.startswith(b"HTTP/1.1 200"):
            head_end = buf.find(b"\r\n\r\n")
            match = _CONTENT_LENGTH.search(buf, 0, head_end) if head_end >= 0 else None
            if match is not None:
                self._body_end = head_end + 4 + int(match.group(1))
        if self._body_end is not None:
            return len(buf) >= self._body_end
        return buf.endswith(_TERMINATOR) and b"[DONE]" in buf[-200:]

    def result(self, now: float) -> Result:
        status = int(self.buf[9:12])
        # the finish frame has "text":"" too
        count = self.buf.count(_TOKEN) - 1 if status == 200 else 0
        end = self.done_at or now
        return Result(self.start, self.ttft, end - self.start, count, status, self.writes)


async def one_stream(
    stream: trio.SocketStream, request: bytes, result_start: float, *, stamped: bool = False
) -> Result:
    """Send one streaming request on ``stream`` and read its whole chunked answer (or a
    refusal's whole answer). Times are ``time.perf_counter`` values; with ``stamped``
    (where the kernel gives receive timestamps) each read is timed when the kernel
    received its bytes, as ``inference-lab load`` times tokens, not when this process got
    round to reading them."""
    sock = stream.socket
    stamped = stamped and enable_receive_timestamps(sock)
    await stream.send_all(request)
    reader = _StreamReader(result_start)
    while True:
        if stamped:
            chunk, receipt = await receive_stamped(sock, 65536)
            now = time.perf_counter()
            if receipt is not None:  # the kernel's receipt, moved onto perf_counter
                now -= trio.current_time() - receipt
        else:
            chunk = await stream.receive_some(65536)
            now = time.perf_counter()
        if not chunk:
            raise ConnectionError("server closed the connection")
        if reader.feed(chunk, now):
            return reader.result(now)


def blocking_stream(sock: socket.socket, request: bytes) -> Result:
    """:func:`one_stream` from a plain blocking socket (no trio: a client outside any
    event loop); times run from just before the request is sent. The caller sets the
    socket's timeout."""
    reader = _StreamReader(time.perf_counter())
    sock.sendall(request)
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("server closed the connection")
        if reader.feed(chunk, time.perf_counter()):
            return reader.result(time.perf_counter())


async def client_loop(
    host: str, port: int, request: bytes, delay: float, stop_at: float, results: list[Result]
) -> None:
    """One closed-loop user on one keep-alive connection: wait ``delay``, then send, read
    to the end of the chunked body, send again until ``stop_at``."""
    stream = await trio.open_tcp_stream(host, port)
    await trio.sleep(delay)
    try:
        while time.perf_counter() < stop_at:
            results.append(await one_stream(stream, request, time.perf_counter()))
    finally:
        await stream.aclose()


# ---------------------------------------------------------------------------------------
# a scraper beside a benchmark


async def read_response(stream: trio.SocketStream, buf: bytearray) -> tuple[int, bytes]:
    """One ``content-length`` HTTP/1.1 response from ``stream`` (``buf`` holds what was
    read past the previous one)."""
    while b"\r\n\r\n" not in buf:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise ConnectionError("server closed the connection")
        buf += chunk
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(rest) < length:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise ConnectionError("server closed the connection")
        rest += chunk
    buf[:] = rest[length:]
    return int(head[9:12]), rest[:length]


async def scrape_loop(
    url: str,
    path: str,
    every: float,
    stop: trio.Event,
    latencies: list[float],
    sizes: list[int],
) -> None:
    """GET ``path`` every ``every`` seconds (on a fixed schedule) until ``stop``."""
    parsed = urllib.parse.urlsplit(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    request = f"GET {path} HTTP/1.1\r\nhost: {host}:{port}\r\n\r\n".encode()
    stream = await trio.open_tcp_stream(host, port)
    buf = bytearray()
    try:
        next_at = trio.current_time()
        while not stop.is_set():
            start = time.perf_counter()
            await stream.send_all(request)
            status, body = await read_response(stream, buf)
            if status != 200:
                raise RuntimeError(f"{path}: HTTP {status}")
            latencies.append(time.perf_counter() - start)
            sizes.append(len(body))
            next_at += every
            with trio.move_on_at(next_at):
                await stop.wait()
    finally:
        await stream.aclose()


async def parked_stream_tokens(
    streams: int, rounds: int, delivery: Any, config: Any, request: bytes
) -> float:
    """Open ``streams`` in-memory hypercorn connections whose requests each park a stream
    writer (``serve.streaming.write_stream``, delivering through ``delivery``) on a sink
    that never ends, then hand every sink one mid-stream token ``rounds`` times, letting
    the writers and the readers run after each round; the CPU seconds the rounds took.
    The app ignores ``request``'s method and path; hypercorn's ``config`` is used as given."""
    import contextlib

    import trio.testing

    from inference_lab.api.encoding import StreamEncoder
    from inference_lab.api.requests import parse_completion_request
    from inference_lab.serve.streaming import StreamSink, write_stream
    from inference_lab.serve.transport import local_connection

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
        if len(sinks) == streams:
            parked.set()
        await write_stream(send, sink, delivery)

    async def drain(client: trio.SocketStream) -> None:
        with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
            while await client.receive_some(1 << 20):
                pass

    spent = 0.0
    async with trio.open_nursery() as nursery:
        for _ in range(streams):
            server, client = local_connection(app, config)
            nursery.start_soon(server.run)
            await client.send_all(request)
            nursery.start_soon(drain, client)
        await parked.wait()
        await trio.testing.wait_all_tasks_blocked()  # every writer parked for frames
        start = time.process_time()
        for _ in range(rounds):
            for sink in sinks:
                sink.on_tokens(1)
            for _ in range(3):  # the writers (woken ones) and the readers run
                await trio.lowlevel.checkpoint()
        spent = time.process_time() - start
        nursery.cancel_scope.cancel()
    return spent
