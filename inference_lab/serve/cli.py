"""``inference-lab serve``: flags, startup banner, the socket, hypercorn, signals.

The top-level CLI (:mod:`inference_lab.cli`) calls :func:`add_parser` to build the
command line and :func:`run` once it has been parsed; ``docs/serve.md`` documents the flags.

Rule 1: every startup failure is one line on stderr: exit code 2 for a bad command line
        (a flag's value out of range: argparse), 1 for one that cannot be served
        (unreadable or invalid config, duplicate model names, no model left, the port).
Rule 2: the command binds the listening socket itself, so it can set ``TCP_USER_TIMEOUT``:
        a client that stops reading can then pin neither a connection nor a graceful
        shutdown for longer than that (hypercorn shields its socket writes).
Rule 3: SIGINT / SIGTERM start a graceful shutdown (``ServeState.drain``): new requests
        get 503 with ``Connection: close``, live ones get ``--shutdown-grace`` seconds,
        then each still live ends with an answer naming the shutdown (a stream: its error
        frame, ``[DONE]`` and a complete chunked body) before hypercorn is told to stop,
        and the process exits 0. A second signal ends the grace period at once; a third
        stops without waiting. No traceback.
Rule 4: the backlog asked for is the one in force: :func:`bind_socket` listens with it
        and hypercorn, which calls ``listen`` again on the socket it adopts, is given the
        same value.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import trio
from hypercorn.trio import serve as hypercorn_serve

from inference_lab.errors import ConfigError
from inference_lab.serve import (
    DEFAULT_CONFIG,
    DEFAULT_HARDWARE,
    DEFAULT_MAX_TOKENS,
    ServeSettings,
    create_app,
    get_state,
    load_settings,
    parse_int_setting,
)
from inference_lab.serve.settings import DEFAULT_BODY_TIMEOUT, ENV_LABELS
from inference_lab.serve.transport.connection import (
    LabConfig,
    enable_receive_timestamps,
    receives_timestamps,
)

__all__ = ["add_parser", "bind_socket", "run", "serve_app"]

PROG = "inference-lab serve"
#: Seconds in-flight requests get to finish after SIGINT / SIGTERM (``--shutdown-grace``).
GRACEFUL_TIMEOUT = 3.0
#: Seconds the last frames of requests ended by a shutdown get to reach their clients
#: before hypercorn cancels the connections (hypercorn's own ``graceful_timeout``).
FLUSH_TIMEOUT = 2.0
#: The listen backlog (``--backlog``); hypercorn's own default is 100.
DEFAULT_BACKLOG = 2048
#: The environment variable ``--control-token`` falls back to (a secret on a command line
#: is visible to every local user in the process list).
CONTROL_TOKEN_ENV = "INFERENCE_LAB_CONTROL_TOKEN"
#: The environment variables ``--api-key`` (a secret, too) and ``--allowed-origins`` fall
#: back to.
API_KEY_ENV = "INFERENCE_LAB_API_KEY"
ORIGINS_ENV = "INFERENCE_LAB_ALLOWED_ORIGINS"
#: Milliseconds sent data may stay unacknowledged (or unsent behind a zero window) before
#: the kernel drops the connection. Accepted sockets inherit it from the listener.
TCP_USER_TIMEOUT_MS = 10_000
#: Seconds an idle keep-alive connection is kept.
KEEP_ALIVE_TIMEOUT = 5.0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``serve`` and its flags on the top-level CLI's subparsers; integer flags
    are checked here (``cli_args.integer``: a bad value is a usage error, exit 2)."""
    from inference_lab.cli_args import integer

    parser: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        description=(
            "Serve an OpenAI-compatible HTTP API. No model runs: each model's "
            "continuous-batching engine is priced by a roofline model of the chosen GPU and "
            "its token streams are paced to wall-clock."
        ),
    )
    parser.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        metavar="PATH|NAME",
        help="a model config, a directory of them (*.toml, sorted; default: configs/), or "
        "the name of a shipped config (gpt-oss-20b)",
    )
    parser.add_argument(
        "--hardware",
        default=DEFAULT_HARDWARE,
        metavar="NAME",
        help="which [hardware.<NAME>] entry to deploy (default: b200)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument(
        "--port",
        type=integer(ge=0, le=65535),
        default=8080,
        help="port to bind (default: 8080; 0 = any)",
    )
    parser.add_argument(
        "--max-waiting",
        type=integer(ge=0),
        metavar="N",
        help="waiting-queue bound for every model (0 = unbounded); overrides [scheduler]",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=integer(ge=1),
        metavar="N",
        help="cap on running requests per worker for every model; overrides [scheduler]",
    )
    parser.add_argument(
        "--workload",
        metavar="PATH|NAME",
        help="a workload TOML or the name of a shipped one: response lengths are "
        "min(output_len_dist sample, max_tokens)",
    )
    parser.add_argument(
        "--seed", type=integer(ge=0), metavar="N", help="seed of the response-length generators"
    )
    parser.add_argument(
        "--default-max-tokens",
        type=integer(ge=1),
        default=DEFAULT_MAX_TOKENS,
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
        help=(
            "the test harness: the x-inference-lab-fault header, scripted responses "
            "(<<respond:{...} markers) and POST /control/engine (kill, restart, slowdown); "
            "never on a server untrusted clients reach (see docs/test-harness.md)"
        ),
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $INFERENCE_LAB_API_KEY; "
        "/health, /version and /metrics stay open)",
    )
    parser.add_argument(
        "--allowed-origins",
        metavar="ORIGINS",
        help="comma-separated browser origins (scheme://host[:port], or *) answered with "
        "CORS headers and preflights (default: $INFERENCE_LAB_ALLOWED_ORIGINS; none)",
    )
    _add_hardening_flags(parser)
    return parser


def _add_hardening_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the listening socket, the control plane, body deadlines and shutdown."""
    from inference_lab.cli_args import integer, number

    parser.add_argument(
        "--backlog",
        type=integer(ge=1, le=65535),
        default=DEFAULT_BACKLOG,
        metavar="N",
        help=f"listen backlog: connections the kernel queues before they are accepted "
        f"(default: {DEFAULT_BACKLOG}; capped by net.core.somaxconn)",
    )
    parser.add_argument(
        "--control-token",
        metavar="TOKEN",
        help="require 'Authorization: Bearer TOKEN' on /control/* (default: "
        "$INFERENCE_LAB_CONTROL_TOKEN; without one, /control/* answers loopback clients only)",
    )
    parser.add_argument(
        "--body-timeout",
        type=number(gt=0),
        default=DEFAULT_BODY_TIMEOUT,
        metavar="SECONDS",
        help=f"a request body must arrive within this many seconds, else 408 "
        f"(default: {DEFAULT_BODY_TIMEOUT:g})",
    )
    parser.add_argument(
        "--shutdown-grace",
        type=number(ge=0),
        default=GRACEFUL_TIMEOUT,
        metavar="SECONDS",
        help=f"on SIGINT/SIGTERM, live requests get this long to finish before they are ended "
        f"with an error naming the shutdown (default: {GRACEFUL_TIMEOUT:g})",
    )


class _UsageError(Exception):
    pass


def _int_flag(value: int | None, flag: str, lowest: int) -> int | None:
    """A flag value as ``add_parser``'s types parsed it (already in range); the bound is
    checked again so that a Namespace built by hand is refused the same way."""
    if value is None:
        return None
    try:
        return parse_int_setting(str(value), lowest)
    except ValueError as exc:
        raise _UsageError(f"{flag} {exc}") from None


def _fail(message: str) -> int:
    from inference_lab.cli_args import fail

    return fail(PROG, message)


def bind_socket(host: str, port: int, backlog: int = DEFAULT_BACKLOG) -> socket.socket:
    """A TCP socket on ``host:port`` listening with ``backlog``, with ``TCP_USER_TIMEOUT``
    set and the kernel stamping what it receives (both inherited by accepted connections on
    Linux). Raises OSError. Serve it with the
    same ``backlog`` (:func:`serve_app`), which hypercorn applies again (Rule 4)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, type_, proto, _, address = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, TCP_USER_TIMEOUT_MS)
        enable_receive_timestamps(sock)  # arrivals stamped by the kernel (connection Rule 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def _somaxconn() -> int | None:
    """The kernel's cap on listen backlogs (Linux), or None where it cannot be read."""
    try:
        return int(Path("/proc/sys/net/core/somaxconn").read_text())
    except (OSError, ValueError):
        return None


def _raise_fd_limit() -> None:
    """Raise this process's soft limit on open files to its hard limit: every connection
    is a file descriptor, and a 1,000-connection burst passes the common soft limit of
    1024 (trio's accept loop would then stall until descriptors are freed)."""
    try:
        import resource
    except ImportError:  # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


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
    sock: socket.socket, graceful_timeout: float, keep_alive_timeout: float, backlog: int
) -> LabConfig:
    config = LabConfig()
    # the connections accepted inherit the listener's arrival stamps (connection Rule 8)
    config.listener_stamps = receives_timestamps(sock)
    # hypercorn adopts the socket by file descriptor; it owns (and closes) it from here.
    config.bind = [f"fd://{sock.detach()}"]
    # ... and calls listen() on it again, with this (Rule 4; its default is 100).
    config.backlog = backlog
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
    backlog: int = DEFAULT_BACKLOG,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` (made by ``create_app``) with hypercorn's trio worker on an
    already-bound ``sock`` (which it takes over, listening with ``backlog``) until
    ``shutdown_trigger`` returns; then the app drains (Rule 3: new requests 503, live ones
    get ``graceful_timeout`` seconds, then end with an answer naming the shutdown) and
    only then is hypercorn told to stop, giving the last frames :data:`FLUSH_TIMEOUT`
    seconds. ``task_status.started`` gets hypercorn's bound URLs. Tests use it with
    ``await nursery.start(serve_app, app, bind_socket("127.0.0.1", 0))``.
    """
    config = _hypercorn_config(sock, FLUSH_TIMEOUT, keep_alive_timeout, backlog)
    trigger = shutdown_trigger
    if shutdown_trigger is not None:
        state = get_state(app)

        async def drain_then_stop() -> None:
            await shutdown_trigger()
            # hypercorn cancels every connection FLUSH_TIMEOUT s after this returns: the
            # runtimes stop first, so no stream is cut mid-message.
            await state.drain(graceful_timeout)

        trigger = drain_then_stop
    await hypercorn_serve(app, config, shutdown_trigger=trigger, task_status=task_status)


async def _serve_until_signalled(
    app: Any, sock: socket.socket, *, grace: float, backlog: int, banner: str
) -> None:
    """Serve until signalled (the first signal drains, the second hurries live requests,
    the third stops at once). ``banner`` is printed once hypercorn serves -- after the
    app's start-up and warm-up -- so a client that waits for it is answered at once: one
    that connected earlier waited in the kernel's accept queue, and the kernel's receive
    time, the request's arrival stamp, counted that wait in its latency."""
    stop = trio.Event()
    state = get_state(app)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                signalled = 0
                async for signum in signals:
                    signalled += 1
                    if signalled == 1:
                        name = signal.Signals(signum).name
                        print(
                            f"{PROG}: {name}: shutting down (new requests get 503; live "
                            f"requests get {grace:g} s)",
                            file=sys.stderr,
                        )
                        stop.set()
                    elif signalled == 2:
                        print(f"{PROG}: second signal: ending live requests now", file=sys.stderr)
                        state.hurry()
                    else:
                        print(f"{PROG}: third signal: stopping now", file=sys.stderr)
                        nursery.cancel_scope.cancel()
                        return

            nursery.start_soon(watch)

            async def serve(task_status: trio.TaskStatus[list[str]]) -> None:
                await serve_app(
                    app,
                    sock,
                    shutdown_trigger=stop.wait,
                    graceful_timeout=grace,
                    backlog=backlog,
                    task_status=task_status,
                )
                nursery.cancel_scope.cancel()

            await nursery.start(serve)
            print(banner, flush=True)


def run(args: argparse.Namespace) -> int:
    """Run ``inference-lab serve``; returns the exit code."""
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

    # An error names the flag, or the variable a secret came from (settings Rule 3).
    labels = {dest: "--" + dest.replace("_", "-") for dest in ENV_LABELS}
    from_env: dict[str, str | None] = {}
    for dest, env in (
        ("control_token", CONTROL_TOKEN_ENV),
        ("api_key", API_KEY_ENV),
        ("allowed_origins", ORIGINS_ENV),
    ):
        value = getattr(args, dest, None)
        if not value and os.environ.get(env):
            value, labels[dest] = os.environ[env], env
        from_env[dest] = value or None
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
            enable_test_harness=bool(args.enable_test_harness),
            control_token=from_env["control_token"],
            body_timeout=args.body_timeout,
            api_key=from_env["api_key"],
            allowed_origins=from_env["allowed_origins"],
            on_skip=skip,
            labels=labels,
        )
    except ConfigError as exc:
        return _fail(str(exc))
    try:
        sock = bind_socket(args.host, port or 0, args.backlog)
    except OSError as exc:
        return _fail(f"cannot listen on {args.host}:{port}: {exc.strerror or exc}")
    _raise_fd_limit()
    app = create_app(settings, server_process=True)
    banner = _banner(settings, args.hardware, _url(sock))
    if settings.enable_test_harness:
        print(
            f"{PROG}: test harness on: requests can inject faults and script answers, and "
            "POST /control/engine can kill, restart and slow down models",
            file=sys.stderr,
        )
    somaxconn = _somaxconn()
    if somaxconn is not None and somaxconn < args.backlog:
        print(
            f"{PROG}: warning: --backlog {args.backlog} is capped at net.core.somaxconn "
            f"({somaxconn}) by the kernel",
            file=sys.stderr,
        )
    serve = partial(
        _serve_until_signalled, grace=args.shutdown_grace, backlog=args.backlog, banner=banner
    )
    try:
        trio.run(serve, app, sock)
    except KeyboardInterrupt:
        pass  # a signal before the handlers were installed: nothing was serving yet
    print(f"{PROG}: stopped", file=sys.stderr)
    return 0
