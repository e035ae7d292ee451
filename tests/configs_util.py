"""Helpers for config and roofline tests: small model configs and hardware profiles written
as real TOML files under ``tmp_path``, each with its own profiles directory.

The configs are plain dicts (``dense_config()``, ``gpu_profile()``) changed with
``merge(base, {"scheduler": {"block_size": 0}})``; ``DELETE`` removes a key. ``write_setup``
writes the config and its profiles and returns the paths to pass to the loader.
"""

from __future__ import annotations

import copy
import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from inference_lab.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
WORKLOADS = CONFIGS / "workloads"
PROFILES = ROOT / "hardware_profiles"
GPT_OSS_20B = CONFIGS / "gpt-oss-20b.toml"

DELETE = object()
"""A ``merge`` value that removes the key."""


# ---------------------------------------------------------------------------------------
# a minimal TOML writer (enough for configs: tables, arrays of tables, scalars, lists)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return "{ " + ", ".join(f"{k} = {_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {v!r} as TOML")


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, Mapping) for x in v)


def _emit(table: Mapping[str, Any], prefix: str, out: list[str]) -> None:
    for key, v in table.items():
        if not isinstance(v, Mapping) and not _is_table_array(v):
            out.append(f"{key} = {_value(v)}")
    for key, v in table.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(v, Mapping):
            out.append(f"\n[{name}]")
            _emit(v, name, out)
        elif _is_table_array(v):
            for item in v:
                out.append(f"\n[[{name}]]")
                _emit(item, name, out)


def dumps(data: Mapping[str, Any]) -> str:
    """TOML text for ``data``; ``tomllib.loads(dumps(d)) == d``."""
    out: list[str] = []
    _emit(data, "", out)
    text = "\n".join(out) + "\n"
    assert tomllib.loads(text) == data, text
    return text


def merge(base: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of ``base`` with ``changes`` merged in, key by key (tables recursively;
    lists are replaced whole; ``DELETE`` removes a key)."""
    out = copy.deepcopy(dict(base))
    for key, v in changes.items():
        if v is DELETE:
            out.pop(key, None)
        elif isinstance(v, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], v)
        else:
            out[key] = copy.deepcopy(v)
    return out


# ---------------------------------------------------------------------------------------
# a small hardware profile and a small dense model


def gpu_profile(**changes: Any) -> dict[str, Any]:
    """A round-number GPU: 1 PFLOP/s bf16, 2 PFLOP/s fp8/fp4, 1 TB/s, 100 GB, 4 GPUs a node
    over a scale-up link without in-network reduction, plus a scale-out link."""
    base: dict[str, Any] = {
        "name": "Test GPU",
        "flops_fp4": 2.0e15,
        "flops_fp8": 2.0e15,
        "flops_bf16": 1.0e15,
        "flops_fp16": 1.0e15,
        "memory_bandwidth": 1.0e12,
        "memory_capacity": 100_000_000_000,
        "fabric": {
            "gpus_per_node": 4,
            "scale_up": {"bandwidth": 1.0e11, "latency": 1.0e-5, "in_network_reduction": False},
            "scale_out": {"bandwidth": 1.0e10, "latency": 1.0e-4, "in_network_reduction": False},
        },
    }
    return merge(base, changes)


def attention(count: int = 4, **changes: Any) -> dict[str, Any]:
    """An attention layer class: 8 heads of 64, 2 KV heads (kvpp = 2·2·64·2 = 512 B)."""
    return merge(
        {"kind": "attention", "count": count, "heads": 8, "head_dim": 64, "kv_heads": 2}, changes
    )


def dense_config(**changes: Any) -> dict[str, Any]:
    """A dense bf16 model of 1e9 parameters with 4 full-attention layers, on ``[hardware.gpu]``
    with every optional key left at its default."""
    base: dict[str, Any] = {
        "model": {
            "name": "tiny-dense",
            "hidden_dim": 1024,
            "max_seq_len": 8192,
            "weights": [
                {"precision": "bf16", "active_params": 1_000_000_000, "resident_params": 1e9}
            ],
            "layers": [attention()],
        },
        "scheduler": {"max_num_batched_tokens": 2048, "max_num_seqs": 16},
        "hardware": {"gpu": {}},
    }
    return merge(base, changes)


def write_setup(
    tmp_path: Path,
    config: Mapping[str, Any] | str,
    profiles: Mapping[str, Mapping[str, Any] | str] | None = None,
    name: str = "model.toml",
) -> tuple[Path, Path]:
    """Write ``config`` (a dict or raw TOML text) and its profiles (default: ``gpu``) under
    ``tmp_path``; returns ``(config path, profiles dir)`` for ``load_model_config``."""
    profiles_dir = tmp_path / "hardware_profiles"
    profiles_dir.mkdir(exist_ok=True)
    for pname, prof in (profiles if profiles is not None else {"gpu": gpu_profile()}).items():
        text = prof if isinstance(prof, str) else dumps(prof)
        (profiles_dir / f"{pname}.toml").write_text(text)
    path = tmp_path / name
    path.write_text(config if isinstance(config, str) else dumps(config))
    return path, profiles_dir


def config_error(func: Any, *args: Any, **kwargs: Any) -> str:
    """Call ``func`` expecting a ConfigError; returns its message after checking it is one
    line."""
    with pytest.raises(ConfigError) as info:
        func(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def moe_config(**hardware: Any) -> dict[str, Any]:
    """A bf16 MoE of 1e9 active / 4e9 resident parameters, 8 experts, 2 per token, in all 4
    layers: per expert (4e9 - 1e9) / 6 = 5e8, shared 1e9 - 2 * 5e8 = 0."""
    return dense_config(
        model={
            "weights": [
                {
                    "precision": "bf16",
                    "active_params": 1_000_000_000,
                    "resident_params": 4_000_000_000,
                    "routing": {"routed_experts": 8, "experts_per_tok": 2, "moe_layers": 4},
                }
            ]
        },
        hardware={"gpu": hardware},
    )
