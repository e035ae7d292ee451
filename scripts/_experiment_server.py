"""Shared plumbing of the ``scripts/*_experiment.py`` programs: a server subprocess and the
capacity control endpoint.

``ServerProcess`` starts ``inference-lab serve --host 127.0.0.1 --port 0 ...`` (the same
Python interpreter, ``-m inference_lab.cli``), reads the URL from its banner, waits for
``GET /health`` to answer 200, and on exit stops it: SIGINT (a graceful shutdown), then
SIGKILL if it has not exited within a few seconds. Only 127.0.0.1 is ever contacted.

``get_capacity`` / ``post_capacity`` speak ``/control/capacity`` (``spec/saturation.md``)
with the load client's own HTTP/1.1 connection (``inference_lab.client.http``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from inference_lab.client.http import (  # noqa: E402
    ConnectionFailed,
    ConnectionPool,
    parse_base_url,
)

STARTUP_TIMEOUT = 20.0
STOP_TIMEOUT = 8.0
_URL = re.compile(r"listening on (http://\S+)")


class ServerProcess:
    """``with ServerProcess(["--config", ..., "--max-num-seqs", "64"]) as server:`` —
    ``server.url`` is the base URL. Blocking (call it outside ``trio.run``)."""

    def __init__(self, args: list[str], *, log: Path | None = None) -> None:
        self.args = args
        self.log = log
        self.url = ""
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> ServerProcess:
        cmd = [sys.executable, "-m", "inference_lab.cli", "serve", "--host", "127.0.0.1"]
        cmd += ["--port", "0", *self.args]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # The server's stderr (its shutdown lines, any error) goes to ``log`` or ours.
        log = open(self.log, "w") if self.log is not None else None  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True, env=env
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
                status, _ = trio.run(request_json, self.url, "GET", "/health", None)
                if status == 200:
                    return
            except ConnectionFailed:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{self.url}/health did not answer 200 in {STARTUP_TIMEOUT} s")

    def stop(self) -> None:
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


async def request_json(url: str, method: str, path: str, body: Any) -> tuple[int, Any]:
    """One HTTP/1.1 exchange with the server at ``url`` (its origin only); returns the status
    and the decoded JSON body. Raises ConnectionFailed when it cannot connect."""
    origin = parse_base_url(url)
    pool = ConnectionPool(origin)
    with trio.fail_after(10):
        conn = await pool.acquire()
        try:
            data = b"" if body is None else json.dumps(body).encode()
            headers = [("host", origin.authority), ("content-type", "application/json")]
            headers.append(("connection", "close"))
            await conn.send_request(method, origin.base_path + path, headers, data)
            response = await conn.receive_response()
            raw = await conn.read_body(1 << 20)
        finally:
            conn.close()
    return response.status_code, json.loads(raw) if raw else None


async def get_capacity(url: str) -> list[dict[str, Any]]:
    status, body = await request_json(url, "GET", "/control/capacity", None)
    if status != 200:
        raise RuntimeError(f"GET /control/capacity: HTTP {status}: {body}")
    return list(body)


async def post_capacity(url: str, **change: int) -> list[dict[str, Any]]:
    """``POST /control/capacity`` with ``change`` (``max_num_seqs``, ``max_waiting``)."""
    status, body = await request_json(url, "POST", "/control/capacity", change)
    if status != 200:
        raise RuntimeError(f"POST /control/capacity {change}: HTTP {status}: {body}")
    return list(body)


def columns(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, list[Any]]:
    """Rows of ``GET /control/capacity`` snapshots as one list per key (compact JSON)."""
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
