"""``inference-lab serve``: flags, the startup banner, then the server (:mod:`.server`).

The top-level CLI (:mod:`inference_lab.cli`) calls :func:`add_parser` to build the
command line and :func:`run` once it has been parsed; ``docs/serve.md`` documents the flags.

Rule 1: every startup failure is one line on stderr: exit code 2 for a bad command line
        (a flag's value out of range: argparse), 1 for one that cannot be served
        (unreadable or invalid config, duplicate model names, no model left, the port).
Rule 2: a signalled shutdown (the server module's Rule 2) exits 0.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from functools import partial
from typing import Any

import attrs
import trio

from inference_lab.errors import ConfigError
from inference_lab.serve import (
    DEFAULT_MAX_TOKENS,
    ServeSettings,
    create_app,
    get_state,
    load_settings,
    parse_int_setting,
)
from inference_lab.serve.lora import add_lora_flags, lora_flags
from inference_lab.serve.server import (
    DEFAULT_BACKLOG,
    GRACEFUL_TIMEOUT,
    bind_socket,
    raise_fd_limit,
    serve_until_signalled,
    somaxconn,
)
from inference_lab.serve.settings import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_KV_HOLD_TIMEOUT,
    DEFAULT_TOOL_CALL_PROBABILITY,
    ENV_LABELS,
    ROLES,
    startup_warnings,
)

__all__ = ["add_parser", "run"]

PROG = "inference-lab serve"
#: The environment variable ``--control-token`` falls back to (a secret on a command line
#: is visible to every local user in the process list).
CONTROL_TOKEN_ENV = "INFERENCE_LAB_CONTROL_TOKEN"
#: The environment variables ``--api-key`` (a secret, too) and ``--allowed-origins`` fall
#: back to.
API_KEY_ENV = "INFERENCE_LAB_API_KEY"
ORIGINS_ENV = "INFERENCE_LAB_ALLOWED_ORIGINS"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``serve`` and its flags on the top-level CLI's subparsers; integer flags
    are checked by argparse (``cli_args.integer``: a bad value is a usage error, exit 2)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        description=(
            "Serve an OpenAI-compatible HTTP API. No model runs: each model's "
            "continuous-batching engine is priced by a roofline model of the chosen GPU and "
            "its token streams are paced to wall-clock."
        ),
    )
    _add_model_flags(parser)
    _add_access_flags(parser)
    _add_agent_flags(parser)
    _add_hardening_flags(parser)
    add_lora_flags(parser)
    _add_rank_flags(parser)
    _add_pd_flags(parser)
    return parser


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    """What is served and where: the configs, the hardware entry, the address, the
    scheduler overrides, the response lengths and the tokenizer."""
    from inference_lab.cli_args import integer

    parser.add_argument(
        "--config",
        metavar="PATH|NAME",
        help="a model config, a directory of them (*.toml, sorted), or the name of a shipped "
        "config (gpt-oss-20b); default: the shipped model configs, whatever the working "
        "directory holds",
    )
    parser.add_argument(
        "--hardware",
        metavar="NAME",
        help="which [hardware.<NAME>] entry to deploy (default: each config's only entry, "
        "else b200)",
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


def _add_access_flags(parser: argparse.ArgumentParser) -> None:
    """Who may do what (the test harness, the API key, CORS) and what answers and
    ``/metrics`` carry (the retry header, the dashboard, the latency buckets)."""
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
    parser.add_argument(
        "--no-should-retry-header",
        action="store_true",
        help="leave 'x-should-retry: false' off 529 answers, so the OpenAI SDK retries them "
        "under its max_retries (default: sent; see docs/saturation.md)",
    )
    parser.add_argument(
        "--no-dashboard",
        action="store_true",
        help="turn the live dashboard off (/control/dashboard answers 404 and no sampler "
        "runs; see docs/dashboard.md)",
    )
    parser.add_argument(
        "--fine-latency-buckets",
        action="store_true",
        help="/metrics: finer TTFT, ITL, E2E and queue histogram buckets (vLLM's and more "
        "below them) for millisecond latencies (see docs/grafana.md)",
    )


def _add_rank_flags(parser: argparse.ArgumentParser) -> None:
    """Data-parallel rank processes (``serve/ranks.py``, ``docs/data-parallel.md``)."""
    from inference_lab.cli_args import integer

    parser.add_argument(
        "--data-parallel-size",
        type=integer(ge=1),
        default=1,
        metavar="N",
        help="serve N complete servers, one process each, on ports --port .. --port + N - 1 "
        "under a supervising parent, for a load balancer in front (default: 1, one "
        "process; not the config's dp_attention; docs/data-parallel.md)",
    )
    parser.add_argument(
        "--data-parallel-rank",
        type=integer(ge=0),
        metavar="R",
        help="serve only rank R of --data-parallel-size on --port (as vLLM's external load "
        "balancing): engine labels, KV-event ports and seeds offset by R",
    )


def _add_pd_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of prefill/decode disaggregation (``docs/disaggregation.md``)."""
    from inference_lab.cli_args import number

    pd = parser.add_argument_group(
        "prefill/decode disaggregation (vLLM's kv_transfer_params; docs/disaggregation.md)"
    )
    pd.add_argument(
        "--role",
        choices=ROLES,
        default="both",
        help="both: kv_transfer_params are ignored (default); prefill: a do_remote_decode "
        "request's KV is held for a decode server; decode: a do_remote_prefill request's KV "
        "is pulled from its prefill server, its transfer priced and paced",
    )
    pd.add_argument(
        "--kv-hold-timeout",
        type=number(gt=0),
        default=DEFAULT_KV_HOLD_TIMEOUT,
        metavar="SECONDS",
        help="a prefill server gives back held KV no decode server pulled after this long "
        f"(vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT; default: {DEFAULT_KV_HOLD_TIMEOUT:g})",
    )
    pd.add_argument(
        "--kv-engine-id",
        metavar="ID",
        help="the remote_engine_id a prefill server's answers carry (default: a random one)",
    )
    pd.add_argument(
        "--kv-peers",
        metavar="HOSTS",
        help="comma-separated hosts, networks (10.0.0.0/8) or * a decode server may pull KV "
        "from besides loopback ones (default: loopback only)",
    )


def _add_agent_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the agent-facing API (``docs/agents.md``)."""
    from inference_lab.cli_args import integer, number

    parser.add_argument(
        "--tool-call-probability",
        type=number(ge=0, le=1),
        default=DEFAULT_TOOL_CALL_PROBABILITY,
        metavar="P",
        help="the chance that a tool_choice 'auto' answer to a fresh question a tool fits "
        "calls a tool; lower after a tool result (default: "
        f"{DEFAULT_TOOL_CALL_PROBABILITY:g}; docs/agents.md#tool-calls)",
    )
    parser.add_argument(
        "--embedding-dim",
        type=integer(ge=1),
        metavar="N",
        help="length of /v1/embeddings vectors for every model (default: each model's hidden_dim)",
    )
    parser.add_argument(
        "--run-to-max-tokens",
        action="store_true",
        help="every prose answer runs to its max_tokens (without --workload, answer lengths "
        "are otherwise drawn from the default length model: docs/serve.md#response-lengths)",
    )
    parser.add_argument(
        "--pooling-models",
        metavar="NAMES",
        help="serve these models (comma-separated names, or 'all') as pooling models: "
        "/v1/rerank, /v1/score, /classify and /pooling (docs/serve.md#pooling-models)",
    )
    parser.add_argument(
        "--no-reasoning-content",
        action="store_true",
        help="chat answers carry reasoning as 'reasoning' only, without the older "
        "'reasoning_content' field",
    )


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
    kv = parser.add_argument_group("KV-cache events (vLLM's ZeroMQ layout; the kv-events extra)")
    kv.add_argument(
        "--kv-events-endpoint",
        metavar="ENDPOINT",
        help="publish each prefix-caching model's KV-cache events on this ZeroMQ PUB endpoint: "
        "bound when it has a wildcard (tcp://*:5557, tcp://127.0.0.1:*) or is ipc:// or "
        "inproc://, connected otherwise (tcp://indexer:5557); the k-th model's port + k",
    )
    kv.add_argument(
        "--kv-events-replay-endpoint",
        metavar="ENDPOINT",
        help="bind a ROUTER socket here that replays missed batches by sequence number "
        "(tcp://*:5558)",
    )
    kv.add_argument(
        "--kv-events-topic",
        default="",
        metavar="TOPIC",
        help="the topic frame of every message; {model} is replaced by the model's name "
        "(default: empty)",
    )
    kv.add_argument(
        "--kv-events-no-token-ids",
        action="store_true",
        help="publish every BlockStored with empty token_ids: subscribers learn which "
        "blocks are cached, not the prompts' tokens",
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


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _banner(settings: ServeSettings, url: str, kv_lines: list[str] | None = None) -> str:
    hardware = ", ".join(dict.fromkeys(d.hardware_name for d in settings.deployments))
    lines = [f"inference-lab serve: {len(settings.deployments)} model(s) on {hardware}"]
    width = max(len(d.model.name) for d in settings.deployments)
    for dep in settings.deployments:
        sched, hw = dep.scheduler, dep.hardware
        bound = str(sched.max_waiting) if sched.max_waiting else "0 (unbounded)"
        extra = f"  tp {hw.tp}" + (f" x {hw.replicas} replicas" if hw.replicas > 1 else "")
        if hw.dp_attention > 1 or hw.ep > 1:
            extra += f" (ep {hw.ep}, dp attention {hw.dp_attention})"
        if sched.frontend_latency:
            extra += f"  frontend latency {sched.frontend_latency * 1e3:g} ms"
        if dep.lora is not None:
            extra += f"  LoRA max_loras {dep.lora.max_loras} ({len(dep.lora.adapters)} adapters)"
        lines.append(
            f"  {dep.model.name:<{width}}  max_num_seqs {sched.max_num_seqs}  "
            f"max_waiting {bound}{extra}  ({dep.config_path})"
        )
    if settings.workload is not None:
        lines.append("  response lengths: min(workload output_len_dist sample, max_tokens)")
    elif settings.run_to_max_tokens:
        lines.append("  response lengths: max_tokens (--run-to-max-tokens)")
    if settings.pooling_models:
        lines.append(f"  pooling models: {', '.join(sorted(settings.pooling_models))}")
    if settings.role == "prefill":
        lines.append(
            f"  role prefill: do_remote_decode KV held up to {settings.kv_hold_timeout:g} s "
            "for a decode server"
        )
    elif settings.role == "decode":
        peers = ", ".join(settings.kv_peers) if settings.kv_peers else "none"
        lines.append(
            f"  role decode: do_remote_prefill KV pulled from loopback prefill servers "
            f"(other peers: {peers})"
        )
    lines.extend(kv_lines or ())
    if settings.data_parallel_size > 1:
        rank, size = settings.data_parallel_rank, settings.data_parallel_size
        lines.append(f"  data-parallel rank {rank} of {size} (engine labels from {rank})")
    lines.append(f"listening on {url}  (Ctrl-C to stop)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run ``inference-lab serve``; returns the exit code."""
    try:
        ints = _int_flags(args)
    except _UsageError as exc:
        return _fail(str(exc))
    try:
        settings = _load(args, ints)
    except ConfigError as exc:
        return _fail(str(exc))
    notes = partial(_notes, settings, args)
    ranks = ints.ranks
    if ranks > 1 and args.data_parallel_rank is None:
        from inference_lab.serve.ranks import run_ranks

        return run_ranks(args, _banner(settings, "").splitlines()[:-1], notes, run)
    if ranks > 1:
        settings = attrs.evolve(
            settings, data_parallel_rank=args.data_parallel_rank, data_parallel_size=ranks
        )
    return _serve(args, settings, ints.port, notes)


@attrs.frozen(kw_only=True)
class _IntFlags:
    """The integer flags, checked (:func:`_int_flag`), and the data-parallel size."""

    port: int | None
    max_waiting: int | None
    max_num_seqs: int | None
    seed: int | None
    default_max_tokens: int | None
    embedding_dim: int | None
    ranks: int


def _int_flags(args: argparse.Namespace) -> _IntFlags:
    """The integer flags checked in range; raises :class:`_UsageError`."""
    port = _int_flag(args.port, "--port", 0)
    if port is not None and port > 65535:
        raise _UsageError(f"--port must be an integer in 0..65535, got {port}")
    return _IntFlags(
        port=port,
        max_waiting=_int_flag(args.max_waiting, "--max-waiting", 0),
        max_num_seqs=_int_flag(args.max_num_seqs, "--max-num-seqs", 1),
        seed=_int_flag(args.seed, "--seed", 0),
        default_max_tokens=_int_flag(args.default_max_tokens, "--default-max-tokens", 1),
        embedding_dim=_int_flag(getattr(args, "embedding_dim", None), "--embedding-dim", 1),
        ranks=_check_ranks(args),
    )


def _load(args: argparse.Namespace, ints: _IntFlags) -> ServeSettings:
    """The settings the command line asks for (secrets and origins fall back to their
    environment variables); raises ConfigError."""

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
        if dest == "allowed_origins":
            if not value and os.environ.get(env):
                value, labels[dest] = os.environ[env], env
            value = value or None
        elif value is None and env in os.environ:
            value, labels[dest] = os.environ[env], env
        from_env[dest] = value  # an empty secret stays "": a start-up error (settings)
    return load_settings(
        config=args.config,
        hardware=args.hardware,
        max_waiting=ints.max_waiting,
        max_num_seqs=ints.max_num_seqs,
        workload=args.workload,
        seed=ints.seed,
        default_max_tokens=ints.default_max_tokens or DEFAULT_MAX_TOKENS,
        tokenizer=args.tokenizer,
        enable_test_harness=bool(args.enable_test_harness),
        should_retry_header=not getattr(args, "no_should_retry_header", False),
        dashboard=not getattr(args, "no_dashboard", False),
        fine_latency_buckets=bool(getattr(args, "fine_latency_buckets", False)),
        control_token=from_env["control_token"],
        body_timeout=args.body_timeout,
        api_key=from_env["api_key"],
        allowed_origins=from_env["allowed_origins"],
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_events_topic=args.kv_events_topic,
        kv_events_no_token_ids=bool(getattr(args, "kv_events_no_token_ids", False)),
        tool_call_probability=getattr(args, "tool_call_probability", DEFAULT_TOOL_CALL_PROBABILITY),
        embedding_dim=ints.embedding_dim,
        run_to_max_tokens=bool(getattr(args, "run_to_max_tokens", False)),
        reasoning_content=not getattr(args, "no_reasoning_content", False),
        pooling_models=getattr(args, "pooling_models", None),
        lora=lora_flags(args),
        role=getattr(args, "role", "both"),
        kv_hold_timeout=getattr(args, "kv_hold_timeout", DEFAULT_KV_HOLD_TIMEOUT),
        kv_engine_id=getattr(args, "kv_engine_id", None),
        kv_peers=getattr(args, "kv_peers", None),
        on_skip=skip,
        labels=labels,
    )


def _serve(
    args: argparse.Namespace, settings: ServeSettings, port: int | None, notes: partial[None]
) -> int:
    """Bind, build the app, print the banner and the notes, and serve until a signal."""
    try:
        sock = bind_socket(args.host, port or 0, args.backlog)
    except OSError as exc:
        return _fail(f"cannot listen on {args.host}:{port}: {exc.strerror or exc}")
    raise_fd_limit()
    try:
        app = create_app(settings, server_process=True)
    except ConfigError as exc:  # a KV-events socket that cannot be bound
        sock.close()
        return _fail(str(exc))
    hub = get_state(app).kv_events
    kv_lines = hub.describe() if hub is not None else []
    banner = _banner(settings, _url(sock), kv_lines)
    notes()
    serve = partial(
        serve_until_signalled,
        grace=args.shutdown_grace,
        backlog=args.backlog,
        banner=banner,
        prog=PROG,
    )
    try:
        trio.run(serve, app, sock)
    except KeyboardInterrupt:
        pass  # a signal before the handlers were installed: nothing was serving yet
    print(f"{PROG}: stopped", file=sys.stderr)
    return 0


def _check_ranks(args: argparse.Namespace) -> int:
    """``--data-parallel-size`` and ``--data-parallel-rank`` against each other and the
    port range; the size."""
    size = _int_flag(getattr(args, "data_parallel_size", 1), "--data-parallel-size", 1) or 1
    rank = getattr(args, "data_parallel_rank", None)
    args.data_parallel_size, args.data_parallel_rank = size, rank
    if rank is not None and rank >= size:
        raise _UsageError(f"--data-parallel-rank {rank} is not below --data-parallel-size {size}")
    if rank is None and args.port and args.port + size - 1 > 65535:
        raise _UsageError(
            f"--port {args.port} with --data-parallel-size {size} needs ports up to "
            f"{args.port + size - 1}, past 65535"
        )
    return size


def _notes(settings: ServeSettings, args: argparse.Namespace) -> None:
    """The start-up notes on stderr: the test harness, exposure warnings, the backlog."""
    if settings.enable_test_harness:
        print(
            f"{PROG}: test harness on: requests can inject faults and script answers, and "
            "POST /control/engine can kill, restart and slow down models",
            file=sys.stderr,
        )
    for line in startup_warnings(settings, args.host):
        print(f"{PROG}: warning: {line}", file=sys.stderr)
    cap = somaxconn()
    if cap is not None and cap < args.backlog:
        print(
            f"{PROG}: warning: --backlog {args.backlog} is capped at net.core.somaxconn "
            f"({cap}) by the kernel",
            file=sys.stderr,
        )
