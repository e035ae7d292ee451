"""``serve``'s settings from text: an integer flag's value (:func:`parse_int_setting`) and,
for a plain hypercorn launch, every setting from one environment variable per ``serve``
flag (:func:`settings_from_env`, through :func:`~inference_lab.serve.settings.load_settings`
like the command line, so both get the same checks and one-line errors)."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping

from inference_lab.errors import ConfigError
from inference_lab.serve.settings import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_KV_HOLD_TIMEOUT,
    DEFAULT_MAX_TOKENS,
    DEFAULT_TOOL_CALL_PROBABILITY,
    ENV_LABELS,
    ServeSettings,
    load_settings,
)

__all__ = ["parse_int_setting", "settings_from_env"]


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


def _env_probability(environ: Mapping[str, str], name: str) -> float:
    raw = environ.get(name, "").strip()
    if not raw:
        return DEFAULT_TOOL_CALL_PROBABILITY
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"{name}: must be a number in 0..1, got {raw!r}")
    return value


def _env_seconds(environ: Mapping[str, str], name: str) -> float | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name}: must be a number of seconds > 0, got {raw!r}")
    return value


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _env_flag(environ: Mapping[str, str], name: str) -> bool:
    raw = environ.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ConfigError(f"{name}: must be one of 1, true, yes, on, 0, false, no, off; got {raw!r}")


def settings_from_env(environ: Mapping[str, str] | None = None) -> ServeSettings:
    """Settings for a plain hypercorn launch, one variable per ``serve`` flag:
    ``INFERENCE_LAB_CONFIG``, ``_HARDWARE``, ``_MAX_WAITING``, ``_MAX_NUM_SEQS``,
    ``_WORKLOAD``, ``_SEED``, ``_DEFAULT_MAX_TOKENS``, ``_TOKENIZER``, ``_CONTROL_TOKEN``,
    ``_BODY_TIMEOUT``,
    ``_API_KEY``, ``_ALLOWED_ORIGINS``, ``_ENABLE_TEST_HARNESS``,
    ``_NO_SHOULD_RETRY_HEADER``, ``_NO_DASHBOARD``, ``_FINE_LATENCY_BUCKETS``,
    ``_KV_EVENTS_ENDPOINT``, ``_KV_EVENTS_REPLAY_ENDPOINT``, ``_KV_EVENTS_TOPIC``,
    ``_KV_EVENTS_NO_TOKEN_IDS``, ``_TOOL_CALL_PROBABILITY``, ``_EMBEDDING_DIM``,
    ``_RUN_TO_MAX_TOKENS``, ``_NO_REASONING_CONTENT``, ``_POOLING_MODELS``, ``_ROLE``,
    ``_KV_HOLD_TIMEOUT``, ``_KV_ENGINE_ID``, ``_KV_PEERS``."""
    env = os.environ if environ is None else environ
    enable_test_harness = _env_flag(env, "INFERENCE_LAB_ENABLE_TEST_HARNESS")
    default_max_tokens = _env_int(env, "INFERENCE_LAB_DEFAULT_MAX_TOKENS", 1)
    return load_settings(
        config=env.get("INFERENCE_LAB_CONFIG") or None,
        hardware=env.get("INFERENCE_LAB_HARDWARE") or None,
        max_waiting=_env_int(env, "INFERENCE_LAB_MAX_WAITING", 0),
        max_num_seqs=_env_int(env, "INFERENCE_LAB_MAX_NUM_SEQS", 1),
        workload=env.get("INFERENCE_LAB_WORKLOAD") or None,
        seed=_env_int(env, "INFERENCE_LAB_SEED", 0),
        default_max_tokens=default_max_tokens or DEFAULT_MAX_TOKENS,
        tokenizer=env.get("INFERENCE_LAB_TOKENIZER") or None,
        control_token=env.get("INFERENCE_LAB_CONTROL_TOKEN"),  # "" is an error, not None
        body_timeout=_env_seconds(env, "INFERENCE_LAB_BODY_TIMEOUT") or DEFAULT_BODY_TIMEOUT,
        api_key=env.get("INFERENCE_LAB_API_KEY"),
        allowed_origins=env.get("INFERENCE_LAB_ALLOWED_ORIGINS") or None,
        enable_test_harness=enable_test_harness,
        should_retry_header=not _env_flag(env, "INFERENCE_LAB_NO_SHOULD_RETRY_HEADER"),
        dashboard=not _env_flag(env, "INFERENCE_LAB_NO_DASHBOARD"),
        fine_latency_buckets=_env_flag(env, "INFERENCE_LAB_FINE_LATENCY_BUCKETS"),
        kv_events_endpoint=env.get("INFERENCE_LAB_KV_EVENTS_ENDPOINT") or None,
        kv_events_replay_endpoint=env.get("INFERENCE_LAB_KV_EVENTS_REPLAY_ENDPOINT") or None,
        kv_events_topic=env.get("INFERENCE_LAB_KV_EVENTS_TOPIC") or "",
        kv_events_no_token_ids=_env_flag(env, "INFERENCE_LAB_KV_EVENTS_NO_TOKEN_IDS"),
        tool_call_probability=_env_probability(env, "INFERENCE_LAB_TOOL_CALL_PROBABILITY"),
        embedding_dim=_env_int(env, "INFERENCE_LAB_EMBEDDING_DIM", 1),
        run_to_max_tokens=_env_flag(env, "INFERENCE_LAB_RUN_TO_MAX_TOKENS"),
        reasoning_content=not _env_flag(env, "INFERENCE_LAB_NO_REASONING_CONTENT"),
        pooling_models=env.get("INFERENCE_LAB_POOLING_MODELS") or None,
        role=env.get("INFERENCE_LAB_ROLE", "").strip() or "both",
        kv_hold_timeout=_env_seconds(env, "INFERENCE_LAB_KV_HOLD_TIMEOUT")
        or DEFAULT_KV_HOLD_TIMEOUT,
        kv_engine_id=env.get("INFERENCE_LAB_KV_ENGINE_ID") or None,
        kv_peers=env.get("INFERENCE_LAB_KV_PEERS") or None,
        on_skip=lambda line: print(f"inference-lab: {line}", file=sys.stderr),
        labels=ENV_LABELS,
    )
