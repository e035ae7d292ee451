"""What the stress scripts share: a server subprocess, raw HTTP/1.1 exchanges over trio
sockets, the server's resource figures (RSS, open files, slots and KV blocks) and the
one-line figure every script prints.

Rule 1: only 127.0.0.1 is contacted, on the port of a server this process started
        (``benchkit.ServerProcess``: ``inference-lab serve --host 127.0.0.1
        --port 0``); every exchange runs under a deadline and every script is bounded in
        time and in count.
Rule 2: the server is judged from outside only: HTTP answers, ``/control/stats``, its log
        (stderr) and ``/proc/<pid>``.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import trio
from benchkit import ServerProcess, get_stats

__all__ = [
    "CHAT",
    "MODEL",
    "Response",
    "Server",
    "chat_request",
    "exchange",
    "fetch",
    "leaks",
    "log_problems",
    "post",
    "raise_fd_limit",
    "read_response",
    "report",
    "rss_mb",
    "open_fds",
    "server",
    "settle",
]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "gpt-oss-20b"
CONFIG = str(ROOT / "configs" / "gpt-oss-20b.toml")
CHAT = "/v1/chat/completions"
#: Seconds one :func:`fetch` may take unless the caller says otherwise.
EXCHANGE_SECONDS = 30.0


def raise_fd_limit() -> int:
    """Raise our soft limit on open files to the hard limit (a burst needs one socket per
    client); returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


@attrs.define
class Server:
    """A running ``inference-lab serve`` subprocess and its log file."""

    process: ServerProcess
    log: Path

    @property
    def url(self) -> str:
        return self.process.url

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def pid(self) -> int:
        assert self.process.proc is not None
        return self.process.proc.pid

    def stop(self) -> int | None:
        """SIGINT (a graceful shutdown; SIGKILL after benchkit's timeout); the exit code."""
        self.process.stop()
        return self.process.proc.returncode if self.process.proc is not None else None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@contextmanager
def server(args: list[str]) -> Iterator[Server]:
    """``inference-lab serve`` on 127.0.0.1 with ``args`` (gpt-oss-20b on b200 unless
    ``--config`` is given), stopped on exit; its stderr goes to a temporary log."""
    if "--config" not in args:
        args = ["--config", CONFIG, *args]
    with tempfile.TemporaryDirectory(prefix="inference-lab-stress-") as tmp:
        log = Path(tmp) / "server.log"
        with ServerProcess(args, log=log, cwd=ROOT) as process:
            yield Server(process, log)


def rss_mb(pid: int) -> float:
    """The resident set of process ``pid`` in MB (``VmRSS``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def log_problems(text: str) -> list[str]:
    """Lines of a server log that show a fault: a traceback or an error logged."""
    return [
        line
        for line in text.splitlines()
        if "Traceback" in line or "unhandled error" in line or " ERROR " in line
    ]


# -- raw HTTP/1.1 --------------------------------------------------------------------------------


@attrs.frozen
class Response:
    """One answer as read off the socket: ``status`` 0 when none came (the connection
    closed or timed out first)."""

    status: int
    headers: dict[str, str]
    body: bytes
    complete: bool  # a chunked body ended with its terminator (always True otherwise)
    raw: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def post(path: str, body: bytes, *, content_type: str = "application/json") -> bytes:
    """A ``Connection: close`` POST of ``body``."""
    return (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: {content_type}\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n".encode()


def chat_request(max_tokens: int, *, stream: bool = True, content: str = "hello") -> bytes:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,  # runs to max_tokens
        "stream": stream,
    }
    return post(CHAT, json.dumps(body).encode())


def _dechunk(data: bytes) -> tuple[bytes, bool]:
    payload, rest = b"", data
    while rest:
        size_line, sep, rest = rest.partition(b"\r\n")
        if not sep:
            return payload, False
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            return payload, False
        if size == 0:
            return payload, True
        payload += rest[:size]
        rest = rest[size + 2 :]
    return payload, False


def read_response(raw: bytes) -> Response:
    """Parse what a ``Connection: close`` exchange received."""
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep or not head.startswith(b"HTTP/1.1 "):
        return Response(0, {}, raw, False, raw)
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.decode("latin-1").strip().lower()] = value.decode("latin-1").strip()
    if headers.get("transfer-encoding") == "chunked":
        body, complete = _dechunk(rest)
    else:
        length = int(headers.get("content-length", len(rest)))
        body, complete = rest[:length], len(rest) >= length
    return Response(status, headers, body, complete, raw)


async def exchange(port: int, request: bytes, into: bytearray) -> None:
    """Send ``request`` on a new connection and append what arrives to ``into`` until the
    server closes it or the connection breaks. Callers bound it (``trio.move_on_after``)
    and parse ``into`` with :func:`read_response` whatever happened."""
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError:
        return
    try:
        await stream.send_all(request)
        while chunk := await stream.receive_some(65536):
            into += chunk
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    finally:
        stream.socket.close()


async def fetch(port: int, request: bytes, seconds: float = EXCHANGE_SECONDS) -> Response:
    """:func:`exchange` bounded by ``seconds``, parsed (status 0: no answer in time)."""
    data = bytearray()
    with trio.move_on_after(seconds):
        await exchange(port, request, data)
    return read_response(bytes(data))


# -- the server's own figures ---------------------------------------------------------------------


async def leaks(url: str) -> dict[str, int]:
    """What the server still holds once every client has gone: requests admitted and not
    finished or aborted (``in_flight``), queue and batch slots, KV blocks in use (as a
    usage fraction times 10^6) and streams being written."""
    stats = await get_stats(url)
    out = {"in_flight": 0, "waiting": 0, "running": 0, "kv_usage_ppm": 0}
    for model in stats["models"]:
        out["in_flight"] += model["admitted"] - model["finished"] - model["aborted"]
        out["waiting"] += model["waiting"]
        out["running"] += model["running"]
        out["kv_usage_ppm"] += round(model["kv_usage"] * 1e6)
    out["open_streams"] = stats["delivery"]["open_streams"]
    return out


async def settle(url: str) -> None:
    """Return once :func:`leaks` are all zero (aborts and the last writes take a moment to
    land). Callers bound it and then read :func:`leaks` once more."""
    while any((await leaks(url)).values()):  # noqa: ASYNC110 - polling another process
        await trio.sleep(0.1)


def report(name: str, figures: dict[str, Any], ok: bool) -> None:
    """Print a script's figures: one human line and one JSON line (``STRESS {...}``)."""
    verdict = "ok" if ok else "FAILED"
    text = ", ".join(f"{k} {v}" for k, v in figures.items())
    print(f"{name}: {verdict}: {text}", flush=True)
    print("STRESS " + json.dumps({"name": name, "ok": ok, **figures}), flush=True)


def monotonic() -> float:
    return time.monotonic()


def fail_exit(ok: bool) -> None:
    sys.exit(0 if ok else 1)
