"""``inference-lab proxy``: flags, the banner, then the proxy until a signal.

Rule 1: this module's top level imports only the standard library and the flag toolkit, so
        ``--help`` and a bad flag cost no trio or hypercorn; ``run`` imports the proxy.
Rule 2: exit codes follow ``cli.py``: 0 stopped by SIGINT / SIGTERM; 1 the port cannot be
        bound; 2 bad flags (a URL that is not ``http://host[:port][/prefix]``, named with
        its flag, in one line).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from inference_lab.cli_args import EXIT_OK, EXIT_USAGE, fail, integer, number

__all__ = ["add_parser", "run"]

PROG = "inference-lab proxy"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``proxy`` and its flags on the top-level CLI's subparsers."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "proxy",
        description=(
            "A prefill/decode proxy: each completion is prefilled on a --prefill server "
            "(serve --role prefill), then decoded on a --decode server (serve --role "
            "decode) with the prefill's kv_transfer_params, its answer streamed through."
        ),
    )
    parser.add_argument(
        "--prefill",
        nargs="+",
        required=True,
        metavar="URL",
        help="the prefill servers (http://host:port)",
    )
    parser.add_argument(
        "--decode",
        nargs="+",
        required=True,
        metavar="URL",
        help="the decode servers (http://host:port)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument(
        "--port",
        type=integer(ge=0, le=65535),
        default=8000,
        help="port to bind (default: 8000; 0 = any)",
    )
    parser.add_argument(
        "--policy",
        choices=("round_robin", "least_outstanding"),
        default="round_robin",
        help="which backend of a pool a request tries first (default: round_robin)",
    )
    parser.add_argument(
        "--no-admission-probe",
        action="store_true",
        help="do not ask a decode server whether it would admit a request before the "
        "prefill is spent on it (GET /kv_transfer/admission)",
    )
    parser.add_argument(
        "--backend-timeout",
        type=number(gt=0),
        default=600.0,
        metavar="SECONDS",
        help="the longest wait on a backend: for an answer to start, and between two "
        "pieces of it (default: 600)",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the proxy; returns the exit code."""
    from inference_lab.client.http import Origin, parse_base_url

    origins: dict[str, tuple[Origin, ...]] = {}
    for flag in ("prefill", "decode"):
        parsed = []
        for url in getattr(args, flag):
            try:
                parsed.append(parse_base_url(url))
            except ValueError as exc:
                message = str(exc).replace("--url", f"--{flag}")
                return fail(PROG, message, EXIT_USAGE)
        origins[flag] = tuple(parsed)
    from inference_lab.proxy.app import ProxyApp, ProxyConfig
    from inference_lab.proxy.serving import bind, serve_until_signalled

    config = ProxyConfig(
        prefill=origins["prefill"],
        decode=origins["decode"],
        policy=args.policy,
        probe=not args.no_admission_probe,
        backend_timeout=args.backend_timeout,
    )
    try:
        sock = bind(args.host, args.port)
    except OSError as exc:
        return fail(PROG, f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    banner = "\n".join(
        [
            f"{PROG}: {len(config.prefill)} prefill, {len(config.decode)} decode ({config.policy}"
            + (", admission probe" if config.probe else "")
            + ")",
            *(f"  prefill {o}" for o in config.prefill),
            *(f"  decode  {o}" for o in config.decode),
            f"listening on {url}  (Ctrl-C to stop)",
        ]
    )
    import trio

    try:
        trio.run(serve_until_signalled, ProxyApp(config), sock, banner)
    except KeyboardInterrupt:
        pass
    print(f"{PROG}: stopped", file=sys.stderr)
    return EXIT_OK
