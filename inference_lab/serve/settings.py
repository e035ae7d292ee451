"""What a serving app is configured with, from flags or from the environment.

Rule 1: settings are loaded and validated before any app exists: every problem is a
        :class:`ConfigError` with a one-line message naming the file, key or variable.
Rule 2: ``inference-lab serve`` flags and the ``INFERENCE_LAB_*`` variables of a plain
        hypercorn launch map one to one and share the same loader (:func:`load_settings`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType

import attrs

from inference_lab.config import Deployment, Workload, load_model_config, load_workload
from inference_lab.errors import ConfigError
from inference_lab.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "DEFAULT_CONFIG",
    "DEFAULT_HARDWARE",
    "DEFAULT_MAX_TOKENS",
    "ServeSettings",
    "load_settings",
    "parse_int_setting",
    "settings_from_env",
]

DEFAULT_CONFIG = "configs/"
DEFAULT_HARDWARE = "b200"
DEFAULT_MAX_TOKENS = 256


@attrs.frozen(kw_only=True)
class ServeSettings:
    """Everything a serving app needs, loaded and validated (see :func:`load_settings`)."""

    deployments: tuple[Deployment, ...]
    workload: Workload | None = None
    seed: int | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    #: Model name -> its tokenizer; a model without one counts by the byte rule.
    tokenizers: Mapping[str, Tokenizer] = attrs.field(factory=lambda: MappingProxyType({}))


def _default_config_path(config: str | os.PathLike[str]) -> Path:
    path = Path(config)
    if str(config) == DEFAULT_CONFIG and not path.exists():
        # Installed elsewhere than the repository root: use the shipped configs.
        shipped = Path(__file__).resolve().parent.parent.parent / "configs"
        if shipped.is_dir():
            return shipped
    return path


def load_settings(
    *,
    config: str | os.PathLike[str] = DEFAULT_CONFIG,
    hardware: str = DEFAULT_HARDWARE,
    max_waiting: int | None = None,
    max_num_seqs: int | None = None,
    workload: str | os.PathLike[str] | None = None,
    seed: int | None = None,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    tokenizer: str | os.PathLike[str] | None = None,
    on_skip: Callable[[str], None] | None = None,
) -> ServeSettings:
    """Load the models to serve; raises ConfigError.

    ``config`` is one model config or a directory of them (``*.toml``, sorted, not
    recursive). In directory mode a file without a ``[hardware.<hardware>]`` entry is
    skipped and reported through ``on_skip``; an invalid file, two configs with the same
    model name, or no model left is an error. ``max_waiting`` / ``max_num_seqs``
    override every model's ``[scheduler]`` value, and ``tokenizer`` every model's
    ``[model].tokenizer``; each tokenizer file is loaded once, here.
    """
    if max_waiting is not None and max_waiting < 0:
        raise ConfigError(f"max_waiting: must be >= 0, got {max_waiting}")
    if max_num_seqs is not None and max_num_seqs < 1:
        raise ConfigError(f"max_num_seqs: must be >= 1, got {max_num_seqs}")
    if default_max_tokens < 1:
        raise ConfigError(f"default_max_tokens: must be >= 1, got {default_max_tokens}")
    path = _default_config_path(config)
    if path.is_dir():
        files = sorted(p for p in path.glob("*.toml") if p.is_file())
        if not files:
            raise ConfigError(f"{path}: no model configs (*.toml) in this directory")
        directory = True
    elif path.is_file():
        files = [path]
        directory = False
    else:
        raise ConfigError(f"{path}: no such file or directory")
    deployments: list[Deployment] = []
    seen: dict[str, Path] = {}
    for file in files:
        model_config = load_model_config(file)
        if hardware not in model_config.deployments:
            available = ", ".join(model_config.deployments)
            if not directory:
                raise ConfigError(
                    f"{file}: hardware.{hardware}: no such entry (available: {available})"
                )
            if on_skip is not None:
                on_skip(f"skipping {file}: no [hardware.{hardware}] entry (has {available})")
            continue
        dep = model_config.deployments[hardware]
        name = dep.model.name
        if name in seen:
            raise ConfigError(
                f"{file}: model.name: '{name}' is already served by {seen[name]} "
                "(model names must be unique)"
            )
        seen[name] = file
        sched = dep.scheduler
        if max_waiting is not None:
            sched = attrs.evolve(sched, max_waiting=max_waiting)
        if max_num_seqs is not None:
            sched = attrs.evolve(sched, max_num_seqs=max_num_seqs)
        deployments.append(attrs.evolve(dep, scheduler=sched))
    if not deployments:
        raise ConfigError(f"{path}: no model config has a [hardware.{hardware}] entry")
    loaded = load_workload(workload) if workload is not None else None
    by_source: dict[str, Tokenizer] = {}
    tokenizers: dict[str, Tokenizer] = {}
    for dep in deployments:
        source = tokenizer if tokenizer is not None else dep.model.tokenizer
        if source is not None:
            key = str(source)
            if key not in by_source:
                by_source[key] = load_tokenizer(Path(source))
            tokenizers[dep.model.name] = by_source[key]
    return ServeSettings(
        deployments=tuple(deployments),
        workload=loaded,
        seed=seed,
        default_max_tokens=default_max_tokens,
        tokenizers=MappingProxyType(tokenizers),
    )


def parse_int_setting(raw: str, lowest: int) -> int:
    """An integer setting given as text (a flag or an environment variable); ValueError
    with the tail of a one-line message when it is not an integer >= ``lowest``."""
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"must be an integer >= {lowest}, got {raw!r}") from None
    if value < lowest:
        raise ValueError(f"must be an integer >= {lowest}, got {value}")
    return value


def _env_int(environ: Mapping[str, str], name: str, lowest: int) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return parse_int_setting(raw, lowest)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None


_TRUE = ("1", "true", "yes", "on")


def settings_from_env(environ: Mapping[str, str] | None = None) -> ServeSettings:
    """Settings for a plain hypercorn launch, one variable per ``serve`` flag:
    ``INFERENCE_LAB_CONFIG``, ``_HARDWARE``, ``_MAX_WAITING``, ``_MAX_NUM_SEQS``,
    ``_WORKLOAD``, ``_SEED``, ``_DEFAULT_MAX_TOKENS``, ``_TOKENIZER``,
    ``_ENABLE_TEST_HARNESS``."""
    env = os.environ if environ is None else environ
    if env.get("INFERENCE_LAB_ENABLE_TEST_HARNESS", "").strip().lower() in _TRUE:
        raise ConfigError(
            "INFERENCE_LAB_ENABLE_TEST_HARNESS: the test-harness features (fault injection, "
            "scripted responses) are not built in this version"
        )
    default_max_tokens = _env_int(env, "INFERENCE_LAB_DEFAULT_MAX_TOKENS", 1)
    return load_settings(
        config=env.get("INFERENCE_LAB_CONFIG") or DEFAULT_CONFIG,
        hardware=env.get("INFERENCE_LAB_HARDWARE") or DEFAULT_HARDWARE,
        max_waiting=_env_int(env, "INFERENCE_LAB_MAX_WAITING", 0),
        max_num_seqs=_env_int(env, "INFERENCE_LAB_MAX_NUM_SEQS", 1),
        workload=env.get("INFERENCE_LAB_WORKLOAD") or None,
        seed=_env_int(env, "INFERENCE_LAB_SEED", 0),
        default_max_tokens=default_max_tokens or DEFAULT_MAX_TOKENS,
        tokenizer=env.get("INFERENCE_LAB_TOKENIZER") or None,
        on_skip=lambda line: print(f"inference-lab: {line}", file=sys.stderr),
    )
