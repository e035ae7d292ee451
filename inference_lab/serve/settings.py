"""What a serving app is configured with, from flags or from the environment.

Rule 1: settings are loaded and validated before any app exists: every problem is a
        :class:`ConfigError` with a one-line message naming the file, key or variable.
Rule 2: ``inference-lab serve`` flags and the ``INFERENCE_LAB_*`` variables of a plain
        hypercorn launch map one to one and share the same loader (:func:`load_settings`).
Rule 3: an error names a setting the way its reader gave it: ``--api-key`` on the command
        line, ``INFERENCE_LAB_API_KEY`` in the environment (the ``labels`` of
        :func:`load_settings`), the setting's own name only from Python.
Rule 4: ``config`` and ``workload`` are paths or, when no such path exists, the names of
        shipped files (``gpt-oss-20b``, ``chat-closed-64``:
        :func:`inference_lab.resources.resolve_shipped`). Without ``config`` the app serves
        the package's shipped model configs, never the working directory's ``configs/``
        (an unrelated folder of that name is not a server's configuration).
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import ParamSpec

import attrs

from inference_lab.api.tokenizer import Tokenizer, load_tokenizer
from inference_lab.core.config import (
    Deployment,
    FaultConfig,
    Workload,
    load_model_config,
    load_workload,
    override_scheduler,
)
from inference_lab.errors import ConfigError
from inference_lab.resources import DEFAULT_HARDWARE, default_hardware, resolve_shipped, shipped_dir
from inference_lab.serve.kv_events import KVEventsSettings, check_endpoint, exposure_warnings
from inference_lab.serve.lora import LoraFlags, apply_lora, runtime_updating

__all__ = [
    "DEFAULT_BODY_TIMEOUT",
    "DEFAULT_HARDWARE",
    "DEFAULT_KV_HOLD_TIMEOUT",
    "DEFAULT_MAX_TOKENS",
    "ENV_LABELS",
    "ROLES",
    "ServeFlags",
    "ServeSettings",
    "load_settings",
    "parse_origins",
    "is_loopback_host",
    "startup_warnings",
]

#: How the environment of a plain hypercorn launch names each setting (Rule 3).
ENV_LABELS: Mapping[str, str] = MappingProxyType(
    {
        name: f"INFERENCE_LAB_{name.upper()}"
        for name in (
            "config",
            "hardware",
            "max_waiting",
            "max_num_seqs",
            "workload",
            "seed",
            "default_max_tokens",
            "tokenizer",
            "control_token",
            "body_timeout",
            "api_key",
            "allowed_origins",
            "enable_test_harness",
            "kv_events_endpoint",
            "kv_events_replay_endpoint",
            "kv_events_topic",
            "kv_events_no_token_ids",
            "tool_call_probability",
            "embedding_dim",
            "pooling_models",
            "role",
            "kv_hold_timeout",
            "kv_engine_id",
            "kv_peers",
        )
    }
)
DEFAULT_MAX_TOKENS = 256
#: Seconds a request body may take to arrive, counted from the request's arrival.
DEFAULT_BODY_TIMEOUT = 10.0
#: The chance that a ``tool_choice: "auto"`` answer to a fresh question that a tool fits
#: calls a tool; after a tool result and when no tool fits it is lower
#: (``api/tool_choice.py``).
DEFAULT_TOOL_CALL_PROBABILITY = 0.9
#: ``--role``: what a server does with vLLM's ``kv_transfer_params``
#: (``docs/disaggregation.md``, "In serve").
ROLES = ("both", "prefill", "decode")
#: Seconds a prefill server holds a finished request's KV for a decode server that never
#: pulls it (vLLM's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s by default).
DEFAULT_KV_HOLD_TIMEOUT = 480.0


@attrs.frozen(kw_only=True)
class ServeSettings:
    """Everything a serving app needs, loaded and validated (:func:`load_settings`)."""

    deployments: tuple[Deployment, ...]
    workload: Workload | None = None
    seed: int | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    #: Model name -> its tokenizer; a model without one counts by the byte rule.
    tokenizers: Mapping[str, Tokenizer] = attrs.field(factory=lambda: MappingProxyType({}))
    #: ``Authorization: Bearer`` token required on ``/control/*``; None: the control
    #: plane answers only loopback clients that name the server by a loopback host.
    control_token: str | None = attrs.field(default=None, repr=False)
    #: Seconds a request body may take to arrive, from the request's arrival (then 408).
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    #: ``Authorization: Bearer`` key required on ``/v1/*`` (401 otherwise); None: open.
    api_key: str | None = attrs.field(default=None, repr=False)
    #: Origins answered with CORS headers (``*``: any); empty: no CORS at all.
    allowed_origins: tuple[str, ...] = ()
    #: The test harness (``docs/test-harness.md``): the fault header, scripted responses
    #: and ``POST /control/engine``. Off: the header is a 400, markers are plain text.
    enable_test_harness: bool = False
    #: (model name, its ``[fault]`` table) for each model config that has one; these
    #: apply with the harness off too (the operator's choice, not a client's).
    faults: tuple[tuple[str, FaultConfig], ...] = ()
    #: A 529 carries ``x-should-retry: false`` (the OpenAI SDK then does not retry it);
    #: False omits the header, so the SDK's ``max_retries`` applies to 529s.
    should_retry_header: bool = True
    #: The live dashboard (``/control/dashboard``, ``serve/dashboard.py``); False: its
    #: paths are 404s and no sampler runs.
    dashboard: bool = True
    #: Finer TTFT / ITL / E2E / queue histogram buckets on ``/metrics`` (vLLM's and more).
    fine_latency_buckets: bool = False
    #: Publish KV-cache events over ZeroMQ (``serve/kv_events.py``); None: no events.
    kv_events: KVEventsSettings | None = None
    #: The chance that a ``tool_choice: "auto"`` answer to a fresh question a tool fits
    #: calls a tool (``docs/agents.md``; lower after a tool result: ``api/tool_choice.py``).
    tool_call_probability: float = DEFAULT_TOOL_CALL_PROBABILITY
    #: The length of ``/v1/embeddings`` vectors for every model (None: each model's
    #: ``hidden_dim``).
    embedding_dim: int | None = None
    #: Every prose answer runs to its ``max_tokens`` (or stop string) instead of drawing
    #: its length from the default length model (``api/lengths.py``) when there is no
    #: workload.
    run_to_max_tokens: bool = False
    #: Chat answers carry reasoning as ``reasoning_content`` (the older field) besides
    #: ``reasoning``; False sends ``reasoning`` only.
    reasoning_content: bool = True
    #: The models served as pooling models: they answer ``/v1/rerank``, ``/v1/score``,
    #: ``/classify`` and ``/pooling`` (``serve/pooling_routes.py``).
    pooling_models: frozenset[str] = frozenset()
    #: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: the adapter load/unload routes exist
    lora_updating: bool = False
    #: This server's place among ``--data-parallel-size`` rank processes
    #: (``serve/ranks.py``): its engines' ``engine`` label and KV-event ranks start at
    #: rank x workers, its KV-event ports are offset by the rank, its seeds are the
    #: given ones + rank. 0 of 1: a single server.
    data_parallel_rank: int = 0
    data_parallel_size: int = 1
    #: Prefill/decode disaggregation (``serve/kv_transfer.py``): ``both`` ignores
    #: ``kv_transfer_params`` (a server without a KV connector); ``prefill`` holds the KV
    #: of a ``do_remote_decode`` request for a decode server; ``decode`` pulls the KV a
    #: ``do_remote_prefill`` request names from its prefill server.
    role: str = "both"
    #: Seconds a prefill server holds a finished request's KV before it gives it back
    #: unpulled (vLLM's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``).
    kv_hold_timeout: float = DEFAULT_KV_HOLD_TIMEOUT
    #: The ``remote_engine_id`` a prefill server's answers carry (None: a random one).
    kv_engine_id: str | None = None
    #: Hosts a decode server pulls KV from besides loopback ones (``*``: any).
    kv_peers: tuple[str, ...] = ()

    def embedding_size(self, deployment: Deployment) -> int:
        """The full length of ``deployment``'s embedding vectors."""
        if self.embedding_dim is not None:
            return self.embedding_dim
        return deployment.model.hidden_dim


@attrs.frozen(kw_only=True)
class ServeFlags:
    """The settings as given -- by ``inference-lab serve``'s flags, the ``INFERENCE_LAB_*``
    variables or Python keywords -- before they are checked and the models loaded
    (:meth:`load`; :func:`load_settings` takes these fields as keywords).

    ``labels`` maps a setting's name to how errors call it (Rule 3): the flag or the
    variable it came from. Model configs a directory holds without the hardware entry
    asked for are reported through ``on_skip``.
    """

    #: One model config or a directory of them (``*.toml``, sorted, not recursive);
    #: None: the shipped model configs (Rule 4).
    config: str | os.PathLike[str] | None = None
    #: The ``[hardware.<hardware>]`` entry each config is deployed on; None: its only
    #: entry, else its ``b200`` one (resources Rule 5).
    hardware: str | None = None
    #: Override every model's ``[scheduler]`` value (>= 0 and >= 1).
    max_waiting: int | None = None
    max_num_seqs: int | None = None
    workload: str | os.PathLike[str] | None = None
    seed: int | None = None
    #: >= 1.
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    #: Overrides every model's ``[model].tokenizer``; each tokenizer file is loaded once.
    tokenizer: str | os.PathLike[str] | None = None
    #: If not None: 1-4096 printable ASCII characters without spaces (it is compared with
    #: an HTTP header; an empty one is an error, never "no token"); ``api_key`` likewise.
    control_token: str | None = attrs.field(default=None, repr=False)
    #: A finite number of seconds > 0.
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    api_key: str | None = attrs.field(default=None, repr=False)
    #: The comma-separated text of ``--allowed-origins`` (:func:`parse_origins`).
    allowed_origins: str | None = None
    enable_test_harness: bool = False
    should_retry_header: bool = True
    dashboard: bool = True
    fine_latency_buckets: bool = False
    #: The replay endpoint and ``kv_events_no_token_ids`` need ``kv_events_endpoint``.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_no_token_ids: bool = False
    #: In 0..1.
    tool_call_probability: float = DEFAULT_TOOL_CALL_PROBABILITY
    #: If not None, >= 1.
    embedding_dim: int | None = None
    run_to_max_tokens: bool = False
    reasoning_content: bool = True
    #: A comma-separated list of served model names, or ``all``.
    pooling_models: str | None = None
    #: The LoRA flags (:func:`~inference_lab.serve.lora.apply_lora`).
    lora: LoraFlags | None = None
    #: One of :data:`ROLES`.
    role: str = "both"
    #: A finite number of seconds > 0.
    kv_hold_timeout: float = DEFAULT_KV_HOLD_TIMEOUT
    #: If not None, 1-256 printable ASCII characters.
    kv_engine_id: str | None = None
    #: Comma-separated host names, addresses or networks (``10.0.0.0/8``), or ``*``.
    kv_peers: str | None = None
    on_skip: Callable[[str], None] | None = None
    labels: Mapping[str, str] | None = None

    def label(self, setting: str) -> str:
        """How errors name ``setting`` (Rule 3)."""
        labels = self.labels
        return labels.get(setting, setting) if labels is not None else setting

    def load(self) -> ServeSettings:
        """Check every setting (in the order of the fields), then load the models to serve;
        raises ConfigError (Rule 1). In directory mode a file without the hardware entry
        is skipped (``on_skip``); an invalid file, two configs with the same model name,
        or no model left is an error."""
        label = self.label
        _check_secret(self.control_token, label("control_token"))
        _check_secret(self.api_key, label("api_key"))
        raw_origins = self.allowed_origins
        origins = (
            parse_origins(raw_origins, label("allowed_origins")) if raw_origins is not None else ()
        )
        self._check_limits()
        kv_events = self._kv_events()
        self._check_answers()
        peers = _check_kv(self.role, self.kv_hold_timeout, self.kv_engine_id, self.kv_peers, label)
        deployments, faults, names = self._deployments()
        deployments = apply_lora(deployments, self.lora)
        pooling = _pooling_models(self.pooling_models, names, label("pooling_models"))
        workload = self.workload
        loaded = (
            load_workload(resolve_shipped(workload, "workload", label("workload")))
            if workload is not None
            else None
        )
        return ServeSettings(
            deployments=tuple(deployments),
            workload=loaded,
            seed=self.seed,
            default_max_tokens=self.default_max_tokens,
            tokenizers=self._tokenizers(deployments),
            control_token=self.control_token,
            body_timeout=self.body_timeout,
            api_key=self.api_key,
            allowed_origins=origins,
            enable_test_harness=self.enable_test_harness,
            faults=faults,
            should_retry_header=self.should_retry_header,
            dashboard=self.dashboard,
            fine_latency_buckets=self.fine_latency_buckets,
            kv_events=kv_events,
            tool_call_probability=self.tool_call_probability,
            embedding_dim=self.embedding_dim,
            run_to_max_tokens=self.run_to_max_tokens,
            reasoning_content=self.reasoning_content,
            pooling_models=pooling,
            lora_updating=runtime_updating(),
            role=self.role,
            kv_hold_timeout=self.kv_hold_timeout,
            kv_engine_id=self.kv_engine_id,
            kv_peers=peers,
        )

    def _check_limits(self) -> None:
        label = self.label
        body_timeout = self.body_timeout
        if not (math.isfinite(body_timeout) and body_timeout > 0):
            raise ConfigError(
                f"{label('body_timeout')}: must be a number of seconds > 0, got {body_timeout}"
            )
        max_waiting, max_num_seqs = self.max_waiting, self.max_num_seqs
        if max_waiting is not None and max_waiting < 0:
            raise ConfigError(f"{label('max_waiting')}: must be >= 0, got {max_waiting}")
        if max_num_seqs is not None and max_num_seqs < 1:
            raise ConfigError(f"{label('max_num_seqs')}: must be >= 1, got {max_num_seqs}")
        if self.default_max_tokens < 1:
            raise ConfigError(
                f"{label('default_max_tokens')}: must be >= 1, got {self.default_max_tokens}"
            )

    def _kv_events(self) -> KVEventsSettings | None:
        """The KV-event publisher's settings (None: no ``kv_events_endpoint``)."""
        label = self.label
        if self.kv_events_endpoint is None:
            for name, given in (
                ("kv_events_replay_endpoint", self.kv_events_replay_endpoint is not None),
                ("kv_events_no_token_ids", self.kv_events_no_token_ids),
            ):
                if given:
                    raise ConfigError(f"{label(name)}: needs {label('kv_events_endpoint')}")
            return None
        replay = self.kv_events_replay_endpoint
        return KVEventsSettings(
            endpoint=check_endpoint(self.kv_events_endpoint, label("kv_events_endpoint")),
            replay_endpoint=check_endpoint(replay, label("kv_events_replay_endpoint"))
            if replay is not None
            else None,
            topic=self.kv_events_topic,
            token_ids=not self.kv_events_no_token_ids,
        )

    def _check_answers(self) -> None:
        label = self.label
        probability = self.tool_call_probability
        if not 0.0 <= probability <= 1.0:
            raise ConfigError(
                f"{label('tool_call_probability')}: must be a number in 0..1, got {probability}"
            )
        if self.embedding_dim is not None and self.embedding_dim < 1:
            raise ConfigError(f"{label('embedding_dim')}: must be >= 1, got {self.embedding_dim}")

    def _config_files(self) -> tuple[Path, list[Path], bool]:
        """The config path (Rule 4), the model configs to load from it, and whether it
        is a directory."""
        if self.config is None:
            path = shipped_dir("configs")
        else:
            path = resolve_shipped(self.config, "config", self.label("config"))
        if path.is_dir():
            files = sorted(p for p in path.glob("*.toml") if p.is_file())
            if not files:
                raise ConfigError(f"{path}: no model configs (*.toml) in this directory")
            return path, files, True
        if path.is_file():
            return path, [path], False
        raise ConfigError(f"{path}: no such file or directory")

    def _deployments(
        self,
    ) -> tuple[list[Deployment], tuple[tuple[str, FaultConfig], ...], list[str]]:
        """Each config's deployment on the hardware entry asked for (scheduler overrides
        applied), the ``[fault]`` tables by model name, and the served model names."""
        path, files, directory = self._config_files()
        hardware = self.hardware
        deployments: list[Deployment] = []
        faults: list[tuple[str, FaultConfig]] = []
        seen: dict[str, Path] = {}
        for file in files:
            model_config = load_model_config(file)
            entry = hardware if hardware is not None else default_hardware(model_config.deployments)
            if entry is None or entry not in model_config.deployments:
                available = ", ".join(model_config.deployments)
                wanted = (
                    f"hardware.{entry}" if entry is not None else f"hardware.{DEFAULT_HARDWARE}"
                )
                if not directory:
                    raise ConfigError(
                        f"{file}: {wanted}: no such entry (available: {available}; "
                        f"choose one with {self.label('hardware')})"
                    )
                if self.on_skip is not None:
                    self.on_skip(f"skipping {file}: no [{wanted}] entry (has {available})")
                continue
            dep = model_config.deployments[entry]
            name = dep.model.name
            if name in seen:
                raise ConfigError(
                    f"{file}: model.name: '{name}' is already served by {seen[name]} "
                    "(model names must be unique)"
                )
            seen[name] = file
            deployments.append(
                override_scheduler(
                    dep, max_num_seqs=self.max_num_seqs, max_waiting=self.max_waiting
                )
            )
            if model_config.fault is not None:
                faults.append((name, model_config.fault))
        if not deployments:
            raise ConfigError(
                f"{path}: no model config has a [hardware.{hardware or DEFAULT_HARDWARE}] entry"
            )
        return deployments, tuple(faults), list(seen)

    def _tokenizers(self, deployments: list[Deployment]) -> Mapping[str, Tokenizer]:
        """Model name -> its tokenizer (``tokenizer``, else its config's), each file
        loaded once."""
        by_source: dict[str, Tokenizer] = {}
        tokenizers: dict[str, Tokenizer] = {}
        for dep in deployments:
            source = self.tokenizer if self.tokenizer is not None else dep.model.tokenizer
            if source is not None:
                key = str(source)
                if key not in by_source:
                    by_source[key] = load_tokenizer(Path(source))
                tokenizers[dep.model.name] = by_source[key]
        return MappingProxyType(tokenizers)


_P = ParamSpec("_P")


def _loader(flags: Callable[_P, ServeFlags]) -> Callable[_P, ServeSettings]:
    def load_settings(*args: _P.args, **kwargs: _P.kwargs) -> ServeSettings:
        """Load and check a serving app's settings, given as :class:`ServeFlags`'s
        fields (keywords); raises ConfigError with a one-line message (Rule 1)."""
        return flags(*args, **kwargs).load()

    return load_settings


#: ``load_settings(**flags)``: :meth:`ServeFlags.load` of the settings given as keywords
#: (:class:`ServeFlags`' fields, checked statically), the loader shared by the command
#: line and the environment (Rule 2).
load_settings = _loader(ServeFlags)


def _check_kv(
    role: str,
    timeout: float,
    engine_id: str | None,
    peers: str | None,
    label: Callable[[str], str],
) -> tuple[str, ...]:
    """The prefill/decode settings checked; the peer hosts of ``kv_peers``."""
    if role not in ROLES:
        raise ConfigError(f"{label('role')}: must be one of {', '.join(ROLES)}, got {role!r}")
    if not (math.isfinite(timeout) and timeout > 0):
        raise ConfigError(
            f"{label('kv_hold_timeout')}: must be a number of seconds > 0, got {timeout}"
        )
    if engine_id is not None and not (
        0 < len(engine_id) <= 256 and all(33 <= ord(c) <= 126 for c in engine_id)
    ):
        raise ConfigError(
            f"{label('kv_engine_id')}: must be 1-256 printable ASCII characters, no spaces"
        )
    if peers is None:
        return ()
    hosts = tuple(dict.fromkeys(h.strip().lower() for h in peers.split(",") if h.strip()))
    if not hosts:
        raise ConfigError(f"{label('kv_peers')}: no host given")
    for host in hosts:
        if "/" in host:
            try:
                ipaddress.ip_network(host, strict=False)
            except ValueError:
                raise ConfigError(
                    f"{label('kv_peers')}: {host!r} is not a network (an address/prefix "
                    "such as 10.0.0.0/8)"
                ) from None
        elif host != "*" and not _HOST.fullmatch(host):
            raise ConfigError(f"{label('kv_peers')}: {host!r} is not a host name or address")
    return hosts


#: A host name, an IPv4 address or an IPv6 address (bracketed or not).
_HOST = re.compile(r"[a-z0-9._-]{1,253}|\[?[0-9a-f:.]{2,45}\]?")


def _pooling_models(text: str | None, served: list[str], name: str) -> frozenset[str]:
    """``--pooling-models``: served model names, comma-separated, or ``all``."""
    if text is None or not text.strip():
        return frozenset()
    if text.strip() == "all":
        return frozenset(served)
    names = [part.strip() for part in text.split(",") if part.strip()]
    for model in names:
        if model not in served:
            raise ConfigError(
                f"{name}: no served model is named {model!r} (served: {', '.join(served)})"
            )
    return frozenset(names)


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 bracketed or not) is loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def startup_warnings(settings: ServeSettings, host: str | None = None) -> list[str]:
    """What an operator should hear before serving these settings on ``host`` (None: not
    known, a plain hypercorn launch), one line each: CORS ``*`` with the control plane
    open to pages (a control token set) or the test harness on, a non-loopback
    address without an API key or with the harness on, and KV-event sockets bound on a
    non-loopback address (``kv_events.exposure_warnings``)."""
    out: list[str] = []
    if "*" in settings.allowed_origins:
        if settings.control_token is not None:
            out.append(
                "--allowed-origins '*' with a control token: every web page may call "
                "/control/* from a browser that holds the token"
            )
        if settings.enable_test_harness:
            out.append(
                "--allowed-origins '*' with the test harness on: every web page may inject "
                "faults and script answers"
            )
    if host is not None and not is_loopback_host(host):
        if settings.enable_test_harness:
            out.append(
                f"listening on {host} with the test harness on: every client that reaches "
                "it may inject faults and script answers"
            )
        if settings.api_key is None:
            out.append(
                f"listening on {host} without --api-key: every client that reaches it may "
                "use the API"
                + (
                    ""
                    if settings.control_token is not None
                    else " (the control plane answers loopback clients only; set "
                    "--control-token to manage the server remotely)"
                )
            )
    return out + exposure_warnings(settings.kv_events)


def _valid_token(token: str) -> bool:
    return 0 < len(token) <= 4096 and all(33 <= ord(c) <= 126 for c in token)


def _check_secret(value: str | None, label: str) -> None:
    """A secret given (not None) is a valid token. An empty one is refused on its own
    line: ``--api-key ""`` or ``INFERENCE_LAB_API_KEY=`` is most often a launcher's unset
    variable, and reading it as "no key" would open what the operator meant to close."""
    if value is None:
        return
    if value == "":
        raise ConfigError(
            f"{label}: is empty (an unset variable?): give 1-4096 printable ASCII characters, "
            "or leave it out for no secret"
        )
    if not _valid_token(value):
        raise ConfigError(f"{label}: must be 1-4096 printable ASCII characters, no spaces")


_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\s]+")


def parse_origins(raw: str, label: str = "allowed_origins") -> tuple[str, ...]:
    """``--allowed-origins``: comma-separated origins as browsers send them
    (``scheme://host[:port]``, no path; compared lower-cased) or ``*`` for any origin.
    Raises ConfigError naming ``label`` (the flag or variable) and the first bad item."""
    origins: list[str] = []
    for item in raw.split(","):
        origin = item.strip().lower()
        if not origin:
            continue
        if origin != "*" and not _ORIGIN.fullmatch(origin):
            raise ConfigError(
                f"{label}: {item.strip()!r} is not an origin "
                "(scheme://host[:port] without a path, or *)"
            )
        if origin not in origins:
            origins.append(origin)
    if not origins:
        raise ConfigError(f"{label}: no origin given")
    return tuple(origins)
