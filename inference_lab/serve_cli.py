"""``inference-lab serve``: flags, startup banner, the socket, hypercorn, signals.

``spec/serve-api.md`` (Command line) fixes the flags. The lead's ``cli.py`` calls
:func:`add_parser` and then :func:`run`.

Rule 1: every startup failure is one line on stderr and exit code 1 (bad flag value,
        unreadable or invalid config, duplicate model names, no model left, the port).
Rule 2: the command binds the listening socket itself, so it can set ``TCP_USER_TIMEOUT``:
        a client that stops reading can then pin neither a connection nor a graceful
        shutdown for longer than that (hypercorn shields its socket writes).
Rule 3: SIGINT / SIGTERM start a graceful shutdown (in-flight streams get
        ``GRACEFUL_TIMEOUT`` seconds); a second signal stops at once. No traceback.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve as hypercorn_serve

from inference_lab.errors import ConfigError
from inference_lab.serve import (
    DEFAULT_CONFIG,
    DEFAULT_HARDWARE,
    DEFAULT_MAX_TOKENS,
    ServeSettings,
    create_app,
    load_settings,
    parse_int_setting,
)

__all__ = ["add_parser", "bind_socket", "run", "serve_app"]

PROG = "inference-lab serve"
#: Seconds in-flight requests get to finish after SIGINT / SIGTERM.
GRACEFUL_TIMEOUT = 3.0
#: Milliseconds sent data may stay unacknowledged (or unsent behind a zero window) before
#: the kernel drops the connection. Accepted sockets inherit it from the listener.
TCP_USER_TIMEOUT_MS = 10_000
#: Seconds an idle keep-alive connection is kept.
KEEP_ALIVE_TIMEOUT = 5.0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``serve`` on the top-level CLI's subparsers (``set_defaults(func=run)``)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="serve the OpenAI HTTP API over simulated, roofline-paced engines",
        description=(
            "Serve an OpenAI-compatible HTTP API. No model runs: each model's "
            "continuous-batching engine is priced by a roofline model of the chosen GPU and "
            "its token streams are paced to wall-clock."
        ),
    )
    parser.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        metavar="PATH",
        help="a model config, or a directory of them (*.toml, sorted; default: configs/)",
    )
    parser.add_argument(
        "--hardware",
        default=DEFAULT_HARDWARE,
        metavar="NAME",
        help="which [hardware.<NAME>] entry to deploy (default: b200)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", default="8080", help="port to bind (default: 8080; 0 = any)")
    parser.add_argument(
        "--max-waiting",
        metavar="N",
        help="waiting-queue bound for every model (0 = unbounded); overrides [scheduler]",
    )
    parser.add_argument(
        "--max-num-seqs",
        metavar="N",
        help="cap on running requests per worker for every model; overrides [scheduler]",
    )
    parser.add_argument(
        "--workload",
        metavar="PATH",
        help="a workload TOML: response lengths are min(output_len_dist sample, max_tokens)",
    )
    parser.add_argument("--seed", metavar="N", help="seed of the response-length generators")
    parser.add_argument(
        "--default-max-tokens",
        default=str(DEFAULT_MAX_TOKENS),
        metavar="N",
        help="max_tokens of a request that sends none (default: 256)",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="count prompt tokens with this tokenizer (a tokenizer.json, a directory holding "
        "one, or a .tiktoken file) for every model; overrides [model].tokenizer",
    )
    parser.add_argument(
        "--enable-test-harness",
        action="store_true",
        help="fault injection and scripted responses (not built in this version)",
    )
    parser.set_defaults(func=run)
    return parser


class _UsageError(Exception):
    pass


def _int_flag(value: str | None, flag: str, lowest: int) -> int | None:
    if value is None:
        return None
    try:
        return parse_int_setting(value, lowest)
    except ValueError as exc:
        raise _UsageError(f"{flag} {exc}") from None


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 1


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` with ``TCP_USER_TIMEOUT`` set (inherited by
    accepted connections on Linux). Raises OSError."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, type_, proto, _, address = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, TCP_USER_TIMEOUT_MS)
        sock.bind(address)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _banner(settings: ServeSettings, hardware: str, url: str) -> str:
    lines = [f"inference-lab serve: {len(settings.deployments)} model(s) on {hardware}"]
    width = max(len(d.model.name) for d in settings.deployments)
    for dep in settings.deployments:
        sched, hw = dep.scheduler, dep.hardware
        bound = str(sched.max_waiting) if sched.max_waiting else "0 (unbounded)"
        extra = f"  tp {hw.tp}" + (f" x {hw.replicas} replicas" if hw.replicas > 1 else "")
        lines.append(
            f"  {dep.model.name:<{width}}  max_num_seqs {sched.max_num_seqs}  "
            f"max_waiting {bound}{extra}  ({dep.config_path})"
        )
    if settings.workload is not None:
        lines.append("  response lengths: min(workload output_len_dist sample, max_tokens)")
    lines.append(f"listening on {url}  (Ctrl-C to stop)")
    return "\n".join(lines)


def _hypercorn_config(
    sock: socket.socket, graceful_timeout: float, keep_alive_timeout: float
) -> HyperConfig:
    config = HyperConfig()
    # hypercorn adopts the socket by file descriptor; it owns (and closes) it from here.
    config.bind = [f"fd://{sock.detach()}"]
    config.graceful_timeout = graceful_timeout
    config.keep_alive_timeout = keep_alive_timeout
    config.accesslog = None
    config.loglevel = "WARNING"
    return config


async def serve_app(
    app: Any,
    sock: socket.socket,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    graceful_timeout: float = GRACEFUL_TIMEOUT,
    keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` with hypercorn's trio worker on an already-bound ``sock`` (which it
    takes over) until ``shutdown_trigger`` returns; then in-flight requests get
    ``graceful_timeout`` seconds. ``task_status.started`` gets hypercorn's bound URLs.
    Tests use it with ``await nursery.start(serve_app, app, bind_socket("127.0.0.1", 0))``.
    """
    config = _hypercorn_config(sock, graceful_timeout, keep_alive_timeout)
    await hypercorn_serve(app, config, shutdown_trigger=shutdown_trigger, task_status=task_status)


async def _serve_until_signalled(app: Any, sock: socket.socket) -> None:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:

            async def watch() -> None:
                async for signum in signals:
                    if stop.is_set():
                        print(f"{PROG}: second signal: stopping now", file=sys.stderr)
                        nursery.cancel_scope.cancel()
                        return
                    name = signal.Signals(signum).name
                    print(
                        f"{PROG}: {name}: shutting down (in-flight requests get "
                        f"{GRACEFUL_TIMEOUT:g} s)",
                        file=sys.stderr,
                    )
                    stop.set()

            nursery.start_soon(watch)
            await serve_app(app, sock, shutdown_trigger=stop.wait)
            nursery.cancel_scope.cancel()


def run(args: argparse.Namespace) -> int:
    """Run ``inference-lab serve``; returns the exit code."""
    if args.enable_test_harness:
        return _fail(
            "--enable-test-harness: the test-harness features (fault injection, scripted "
            "responses) are not built in this version"
        )
    try:
        port = _int_flag(args.port, "--port", 0)
        if port is not None and port > 65535:
            raise _UsageError(f"--port must be an integer in 0..65535, got {port}")
        max_waiting = _int_flag(args.max_waiting, "--max-waiting", 0)
        max_num_seqs = _int_flag(args.max_num_seqs, "--max-num-seqs", 1)
        seed = _int_flag(args.seed, "--seed", 0)
        default_max_tokens = _int_flag(args.default_max_tokens, "--default-max-tokens", 1)
    except _UsageError as exc:
        return _fail(str(exc))

    def skip(line: str) -> None:
        print(f"{PROG}: {line}", file=sys.stderr)

    try:
        settings = load_settings(
            config=args.config,
            hardware=args.hardware,
            max_waiting=max_waiting,
            max_num_seqs=max_num_seqs,
            workload=args.workload,
            seed=seed,
            default_max_tokens=default_max_tokens or DEFAULT_MAX_TOKENS,
            tokenizer=args.tokenizer,
            on_skip=skip,
        )
    except ConfigError as exc:
        return _fail(str(exc))
    try:
        sock = bind_socket(args.host, port or 0)
    except OSError as exc:
        return _fail(f"cannot listen on {args.host}:{port}: {exc.strerror or exc}")
    app = create_app(settings, server_process=True)
    print(_banner(settings, args.hardware, _url(sock)), flush=True)
    try:
        trio.run(_serve_until_signalled, app, sock)
    except KeyboardInterrupt:
        pass  # a signal before the handlers were installed: nothing was serving yet
    print(f"{PROG}: stopped", file=sys.stderr)
    return 0
