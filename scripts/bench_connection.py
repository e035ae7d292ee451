"""What a refused request on a new connection costs the server, against its floors.

One client (this process, blocking sockets) sends requests one after another, each on a
new connection to 127.0.0.1 (connect, send, read to the server's close, close), and
prints the server process's CPU time per connection (from ``/proc``: Linux only) for
four servers, each started as a process of its own and warmed up first:

- ``trio``: a bare trio handler that reads the request head and answers a fixed 529 --
  what accepting, reading, writing and closing cost a trio process at all;
- ``hypercorn``: hypercorn's trio worker, as shipped, serving a minimal ASGI app that
  answers 529 (no Quart, no route, no engine);
- ``hooked``: the same, with inference-lab's connection server in place
  (``install_connection_hook``: arrival stamps, close watch, single writes, the idle
  timer);
- ``serve``: ``inference-lab serve`` refusing a completion with 529 for real (JSON,
  validation, the depth check) on Llama-3-70B held full (``max_num_seqs 1, max_waiting
  1``, one long request running, one waiting; its 17.5 ms steps cost next to nothing).

Each figure is the median of ``--repeats`` rounds of ``--connections`` connections, the
servers taken in turn within a round (this machine's speed drifts); the last column is
the ratio to ``hypercorn`` measured in the same run.

    python scripts/bench_connection.py
    python scripts/bench_connection.py --connections 3000 --repeats 5

Only 127.0.0.1 is contacted; every server started is stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

KINDS = ("trio", "hypercorn", "hooked", "serve")
PINNED = "Llama-3-70B"
ANSWER = b'{"error":{"message":"full","type":"overloaded_error","code":529}}'


def chat_request(max_tokens: int) -> bytes:
    """A chat completion for the pinned model, as bytes on the wire."""
    body = json.dumps(
        {
            "model": PINNED,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": max_tokens,
            "ignore_eos": True,  # runs to max_tokens
        }
    ).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
    ) + body


REQUEST = chat_request(1)
_CONTENT_LENGTH = re.compile(rb"(?i)\r\ncontent-length: *(\d+)")
WARM_UP = 200
TIMEOUT = 10.0
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# ---------------------------------------------------------------- the servers (children)
async def _minimal_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            kind = message["type"].removeprefix("lifespan.")
            await send({"type": f"lifespan.{kind}.complete"})
            if kind == "shutdown":
                return
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(ANSWER))]
    await send({"type": "http.response.start", "status": 529, "headers": headers})
    await send({"type": "http.response.body", "body": ANSWER})


def _child(kind: str) -> int:
    """Serve on 127.0.0.1 (an ephemeral port, printed) until stdin closes."""
    import trio

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    print(sock.getsockname()[1], flush=True)

    async def until_stdin_closes() -> None:
        await trio.to_thread.run_sync(sys.stdin.read)

    if kind == "trio":
        head = (
            b"HTTP/1.1 529 \r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % len(ANSWER)
        ) + ANSWER

        async def handler(stream: trio.SocketStream) -> None:
            data = b""
            while b"\r\n\r\n" not in data:
                piece = await stream.receive_some(65536)
                if not piece:
                    return
                data += piece
            await stream.send_all(head)

        async def serve_trio() -> None:
            listeners = [trio.SocketListener(trio.socket.from_stdlib_socket(sock))]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.serve_listeners, handler, listeners)
                await until_stdin_closes()
                nursery.cancel_scope.cancel()

        trio.run(serve_trio)
        return 0

    from hypercorn.config import Config
    from hypercorn.trio import serve

    if kind == "hooked":
        from inference_lab.serve.transport import install_connection_hook

        install_connection_hook()
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]
    config.accesslog = None
    config.loglevel = "WARNING"
    trio.run(partial(serve, _minimal_app, config, shutdown_trigger=until_stdin_closes))
    return 0


# ---------------------------------------------------------------- the client (parent)
def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def _refused(port: int, count: int) -> None:
    """``count`` requests, each on a new connection that the client closes once it has
    the whole answer (as ``bench_overload.py``'s refused clients do); RuntimeError unless
    each answer is a 529."""
    for _ in range(count):
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as conn:
            conn.sendall(REQUEST)
            answer = b""
            while b"\r\n\r\n" not in answer:
                piece = conn.recv(65536)
                if not piece:
                    raise RuntimeError(f"the server closed mid-answer: {answer[:60]!r}")
                answer += piece
            head, _, body = answer.partition(b"\r\n\r\n")
            length = _CONTENT_LENGTH.search(head)
            if not head.startswith(b"HTTP/1.1 529") or length is None:
                raise RuntimeError(f"expected a 529 with a length, got {head[:60]!r}")
            while len(body) < int(length.group(1)):
                piece = conn.recv(65536)
                if not piece:
                    raise RuntimeError("the server closed mid-body")
                body += piece


class Server:
    """One server under test: a child of this script, or ``inference-lab serve``."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.holders: list[socket.socket] = []
        self.serve: Any = None
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> Server:
        if self.kind == "serve":
            import trio
            from benchkit import ServerProcess, post_capacity

            self.serve = ServerProcess(["--hardware", "b200"], log=Path(os.devnull))
            self.serve.__enter__()
            url = self.serve.url
            self.pid = self.serve.proc.pid
            self.port = int(url.rsplit(":", 1)[1])
            trio.run(lambda: post_capacity(url, model=PINNED, max_num_seqs=1, max_waiting=1))
            self._hold_full()
        else:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, "--child", self.kind],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert self.proc.stdout is not None
            self.pid = self.proc.pid
            self.port = int(self.proc.stdout.readline())
        _refused(self.port, WARM_UP)
        return self

    def _hold_full(self) -> None:
        request = chat_request(8000)
        for _ in range(2):  # one runs, one waits
            holder = socket.create_connection(("127.0.0.1", self.port), timeout=TIMEOUT)
            holder.sendall(request)
            self.holders.append(holder)
            time.sleep(0.2)

    def cpu_per_connection(self, count: int) -> float:
        before = _cpu_seconds(self.pid)
        _refused(self.port, count)
        return (_cpu_seconds(self.pid) - before) / count

    def __exit__(self, *exc_info: object) -> None:
        for holder in self.holders:
            holder.close()
        if self.serve is not None:
            self.serve.stop()
        if self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        return _child(sys.argv[2])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=2000, help="per round and server")
    parser.add_argument("--repeats", type=int, default=3, help="rounds")
    args = parser.parse_args()
    if args.connections < 100 or args.repeats < 1:
        parser.error("--connections must be at least 100 and --repeats at least 1")
    if not Path(f"/proc/{os.getpid()}/stat").exists():
        print("bench_connection: needs /proc to read a process's CPU time (Linux)", file=sys.stderr)
        return 1
    spent: dict[str, list[float]] = {kind: [] for kind in KINDS}
    servers = [Server(kind) for kind in KINDS]
    try:
        for server in servers:
            server.__enter__()
        for _ in range(args.repeats):
            for server in servers:
                spent[server.kind].append(server.cpu_per_connection(args.connections))
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"bench_connection: {exc}", file=sys.stderr)
        return 1
    finally:
        for server in servers:
            server.__exit__(None, None, None)
    base = statistics.median(spent["hypercorn"])
    print(
        f"server CPU per refused request on a new connection ({args.connections} connections "
        f"x {args.repeats} rounds, one at a time; median, all rounds, ratio to hypercorn)"
    )
    for kind in KINDS:
        median = statistics.median(spent[kind])
        rounds = ", ".join(f"{value * 1e6:.0f}" for value in spent[kind])
        print(f"  {kind:<10} {median * 1e6:6.0f} us  ({rounds})  x{median / base:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
