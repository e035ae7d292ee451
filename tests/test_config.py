"""Config loading (``docs/configuration.md``): defaults, strict types, ranges, whole-file validation,
one-line errors naming the file and the key path; workloads and their length distributions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inference_lab.core.config import (
    FixedDist,
    LognormalDist,
    NormalDist,
    UniformDist,
    load_deployment,
    load_hardware_profile,
    load_model_config,
    load_workload,
    select_deployment,
)
from tests.configs_util import (
    DELETE,
    WORKLOADS,
    attention,
    config_error,
    dense_config,
    dumps,
    gpu_profile,
    merge,
    write_setup,
)


def load(tmp_path: Path, config: Any, profiles: Any = None) -> Any:
    path, profiles_dir = write_setup(tmp_path, config, profiles)
    return load_model_config(path, profiles_dir)


def load_error(tmp_path: Path, config: Any, profiles: Any = None) -> tuple[Path, str]:
    """The one-line ConfigError message of loading ``config``, and the config's path."""
    path, profiles_dir = write_setup(tmp_path, config, profiles)
    return path, config_error(load_model_config, path, profiles_dir)


def assert_names(tmp_path: Path, config: Any, key_path: str, *fragments: str) -> str:
    """Loading ``config`` fails with ``<file>: <key_path>: ...`` containing ``fragments``."""
    path, message = load_error(tmp_path, config)
    assert message.startswith(f"{path}: {key_path}:"), message
    for fragment in fragments:
        assert fragment in message, message
    return message


# ---------------------------------------------------------------------------------------
# a valid config and its defaults


def test_valid_config_applies_every_documented_default(tmp_path: Path) -> None:
    """A config giving only required keys loads with every default of docs/configuration.md applied."""
    cfg = load(tmp_path, dense_config())
    dep = cfg.deployments["gpu"]
    s = dep.scheduler
    assert (s.max_num_batched_tokens, s.max_num_seqs) == (2048, 16)
    assert s.max_waiting == 0
    assert s.policy == "fcfs"
    assert s.enable_chunked_prefill is True
    assert s.long_prefill_token_threshold == 0
    assert s.block_size == 16
    assert s.gpu_memory_utilization == 0.9
    assert s.kv_cache_capacity == 0
    hw = dep.hardware
    assert (hw.tp, hw.ep, hw.replicas) == (1, 1, 1)
    assert hw.router == "round_robin"
    assert (hw.time_correction.alpha, hw.time_correction.beta) == (1.0, 0.0)
    m = dep.model
    assert m.attention_precision == "bf16"
    assert m.activation_bytes == 2
    (layer,) = m.layers
    assert layer.kv_precision == "bf16"
    assert layer.kv_shared is False
    assert layer.window == 0
    assert m.weights[0].routing is None
    assert dep.hardware_name == "gpu"
    assert dep.profile.name == "Test GPU"
    assert dep.profile.fabric is not None
    assert dep.profile.fabric.scale_up.in_network_reduction is False


def test_link_in_network_reduction_defaults_to_false(tmp_path: Path) -> None:
    """A fabric link without ``in_network_reduction`` loads with it false."""
    prof = gpu_profile()
    del prof["fabric"]["scale_up"]["in_network_reduction"]
    path, profiles_dir = write_setup(
        tmp_path, dense_config(hardware={"gpu": {"tp": 2}}), {"gpu": prof}
    )
    for profile in (
        load_hardware_profile(profiles_dir / "gpu.toml"),
        load_model_config(path, profiles_dir).deployments["gpu"].profile,
    ):
        assert profile.fabric is not None
        assert profile.fabric.scale_up.in_network_reduction is False


def test_fp32_flop_rate_is_half_the_fp16_rate(tmp_path: Path) -> None:
    """A profile's fp32 rate is flops_fp16 / 2, so an fp32 model deploys on it."""
    cfg = load(tmp_path, dense_config(model={"attention_precision": "fp32"}))
    profile = cfg.deployments["gpu"].profile
    assert profile.flops("fp32") == pytest.approx(0.5e15)
    assert profile.flops("fp8") == 2.0e15


@pytest.mark.parametrize("spelling", ["SJF", "Sjf", "sjf"])
def test_policy_is_case_insensitive(tmp_path: Path, spelling: str) -> None:
    """``policy`` is matched case-insensitively and stored lower-case."""
    cfg = load(tmp_path, dense_config(scheduler={"policy": spelling}))
    assert cfg.deployments["gpu"].scheduler.policy == "sjf"


def test_hardware_scheduler_override_merges_key_by_key(tmp_path: Path) -> None:
    """``[hardware.x] scheduler = {...}`` replaces only the keys it names; the other keys
    (and the other entries) keep ``[scheduler]``'s values."""
    text = """
[model]
name = "tiny"
hidden_dim = 1024
max_seq_len = 8192
weights = [{ precision = "bf16", active_params = 1000000000, resident_params = 1000000000 }]
layers = [{ kind = "attention", count = 4, heads = 8, head_dim = 64, kv_heads = 2 }]

[scheduler]
max_num_batched_tokens = 2048
max_num_seqs = 16
block_size = 32
policy = "sjf"

[hardware.gpu]
scheduler = { max_num_seqs = 4, max_waiting = 7 }

[hardware.other]
tp = 1
"""
    cfg = load(tmp_path, text, {"gpu": gpu_profile(), "other": gpu_profile()})
    gpu = cfg.deployments["gpu"].scheduler
    assert (gpu.max_num_seqs, gpu.max_waiting) == (4, 7)
    assert (gpu.max_num_batched_tokens, gpu.block_size, gpu.policy) == (2048, 32, "sjf")
    other = cfg.deployments["other"].scheduler
    assert (other.max_num_seqs, other.max_waiting, other.block_size) == (16, 0, 32)
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_waiting) == (16, 0)


def test_integer_is_accepted_where_a_float_is_expected(tmp_path: Path) -> None:
    """``gpu_memory_utilization = 1`` and ``alpha = 2`` (ints) load as floats."""
    cfg = load(
        tmp_path,
        dense_config(
            scheduler={"gpu_memory_utilization": 1},
            hardware={"gpu": {"time_correction": {"alpha": 2, "beta": 0}}},
        ),
    )
    dep = cfg.deployments["gpu"]
    assert dep.scheduler.gpu_memory_utilization == 1.0
    assert dep.hardware.time_correction.alpha == 2.0
    assert dep.hardware.time_correction.beta == 0.0


# ---------------------------------------------------------------------------------------
# unknown keys


@pytest.mark.parametrize(
    ("changes", "key_path"),
    [
        ({"max_num_seqs": 4}, "max_num_seqs"),
        ({"scheduler": {"max_num_seq": 4}}, "scheduler.max_num_seq"),
        ({"model": {"num_layers": 4}}, "model.num_layers"),
        ({"model": {"layers": [attention(windw=128)]}}, "model.layers[0].windw"),
        (
            {
                "model": {
                    "weights": [
                        {
                            "precision": "bf16",
                            "active_params": 1,
                            "resident_params": 1,
                            "resident": 2,
                        }
                    ]
                }
            },
            "model.weights[0].resident",
        ),
        ({"hardware": {"gpu": {"tpp": 2}}}, "hardware.gpu.tpp"),
        (
            {"hardware": {"gpu": {"time_correction": {"gamma": 1.0}}}},
            "hardware.gpu.time_correction.gamma",
        ),
        (
            {"hardware": {"gpu": {"scheduler": {"block_sise": 8}}}},
            "hardware.gpu.scheduler.block_sise",
        ),
    ],
)
def test_unknown_key_is_an_error_naming_its_path(
    tmp_path: Path, changes: dict[str, Any], key_path: str
) -> None:
    """A misspelled or unknown key anywhere in a model config is a load error naming it."""
    assert_names(tmp_path, merge(dense_config(), changes), key_path, "unknown key")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        # a typo of a required key: the typo is named, with the key it stands for, and
        # the required key it leaves missing is not reported as a second error
        (
            {"scheduler": {"max_num_seqs": DELETE, "max_num_seq": 4}},
            "scheduler.max_num_seq: unknown key (did you mean max_num_seqs?)",
        ),
        (
            {"model": {"hidden_dim": DELETE, "hiden_dim": 64}},
            "model.hiden_dim: unknown key (did you mean hidden_dim?)",
        ),
        # a typo of an optional key, next to a genuinely missing key: the typo first
        (
            {"scheduler": {"max_num_batched_tokens": DELETE, "block_sise": 8}},
            "scheduler.block_sise: unknown key (did you mean block_size?) (and 1 more)",
        ),
        # nothing close: no guess
        ({"scheduler": {"zzz": 1}}, "scheduler.zzz: unknown key"),
    ],
)
def test_a_typod_key_is_named_before_what_it_leaves_missing(
    tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    """A typo'd key reads as the typo (with the key it resembles), not as ``missing required
    key (and 1 more)``: unknown keys come first, and a missing key explained by one is
    not counted again."""
    path, got = load_error(tmp_path, merge(dense_config(), changes))
    assert got == f"{path}: {message}"


@pytest.mark.parametrize(
    ("changes", "key_path"),
    [
        ({"flops_int8": 1.0e15}, "flops_int8"),
        ({"fabric": {"scale_up": {"jitter": 1.0}}}, "fabric.scale_up.jitter"),
    ],
)
def test_unknown_key_in_a_profile_is_an_error_naming_the_profile(
    tmp_path: Path, changes: dict[str, Any], key_path: str
) -> None:
    """An unknown key in a hardware profile fails the config that uses it, and the message
    starts with the profile's path and the key."""
    path, profiles_dir = write_setup(tmp_path, dense_config(), {"gpu": gpu_profile(**changes)})
    message = config_error(load_model_config, path, profiles_dir)
    assert message.startswith(f"{profiles_dir / 'gpu.toml'}: {key_path}:"), message
    assert "unknown key" in message


# ---------------------------------------------------------------------------------------
# strict scalars


@pytest.mark.parametrize(
    ("changes", "key_path", "fragment"),
    [
        ({"scheduler": {"max_num_seqs": 7.9}}, "scheduler.max_num_seqs", "7.9"),
        ({"scheduler": {"block_size": 16.0}}, "scheduler.block_size", "16.0"),
        ({"model": {"hidden_dim": True}}, "model.hidden_dim", "True"),
        (
            {"scheduler": {"enable_chunked_prefill": "false"}},
            "scheduler.enable_chunked_prefill",
            "'false'",
        ),
        ({"model": {"layers": [attention(kv_shared=1)]}}, "model.layers[0].kv_shared", "1"),
        (
            {"scheduler": {"gpu_memory_utilization": "0.9"}},
            "scheduler.gpu_memory_utilization",
            "'0.9'",
        ),
        (
            {"hardware": {"gpu": {"time_correction": {"beta": "0"}}}},
            "hardware.gpu.time_correction.beta",
            "'0'",
        ),
        ({"model": {"name": 7}}, "model.name", "7"),
        (
            {"scheduler": {"gpu_memory_utilization": True}},
            "scheduler.gpu_memory_utilization",
            "True",
        ),
        ({"hardware": {"gpu": {"tp": "2"}}}, "hardware.gpu.tp", "'2'"),
    ],
)
def test_scalars_are_never_coerced(
    tmp_path: Path, changes: dict[str, Any], key_path: str, fragment: str
) -> None:
    """``7.9`` is not an int, ``true`` is not an int, ``"false"`` is not a bool, a string is
    not a number: each is an error naming the key and the offending value."""
    assert_names(tmp_path, merge(dense_config(), changes), key_path, fragment)


# ---------------------------------------------------------------------------------------
# ranges


def test_max_num_seqs_zero_has_the_documented_message(tmp_path: Path) -> None:
    """``max_num_seqs = 0`` fails with exactly ``<file>: scheduler.max_num_seqs: must be >= 1,
    got 0``."""
    path, message = load_error(tmp_path, dense_config(scheduler={"max_num_seqs": 0}))
    assert message == f"{path}: scheduler.max_num_seqs: must be >= 1, got 0"


BAD_RANGES: list[tuple[str, dict[str, Any], str]] = [
    (
        "batched_tokens",
        {"scheduler": {"max_num_batched_tokens": 0}},
        "scheduler.max_num_batched_tokens",
    ),
    ("max_num_seqs", {"scheduler": {"max_num_seqs": -3}}, "scheduler.max_num_seqs"),
    ("max_waiting", {"scheduler": {"max_waiting": -1}}, "scheduler.max_waiting"),
    (
        "threshold",
        {"scheduler": {"long_prefill_token_threshold": -1}},
        "scheduler.long_prefill_token_threshold",
    ),
    ("block_size", {"scheduler": {"block_size": 0}}, "scheduler.block_size"),
    ("util_zero", {"scheduler": {"gpu_memory_utilization": 0}}, "scheduler.gpu_memory_utilization"),
    (
        "util_above_one",
        {"scheduler": {"gpu_memory_utilization": 1.01}},
        "scheduler.gpu_memory_utilization",
    ),
    (
        "util_negative",
        {"scheduler": {"gpu_memory_utilization": -0.5}},
        "scheduler.gpu_memory_utilization",
    ),
    ("kv_capacity", {"scheduler": {"kv_cache_capacity": -1}}, "scheduler.kv_cache_capacity"),
    ("tp", {"hardware": {"gpu": {"tp": 0}}}, "hardware.gpu.tp"),
    ("ep", {"hardware": {"gpu": {"ep": 0}}}, "hardware.gpu.ep"),
    ("replicas", {"hardware": {"gpu": {"replicas": 0}}}, "hardware.gpu.replicas"),
    (
        "alpha_zero",
        {"hardware": {"gpu": {"time_correction": {"alpha": 0}}}},
        "hardware.gpu.time_correction.alpha",
    ),
    (
        "alpha_negative",
        {"hardware": {"gpu": {"time_correction": {"alpha": -1.0}}}},
        "hardware.gpu.time_correction.alpha",
    ),
    (
        "beta",
        {"hardware": {"gpu": {"time_correction": {"beta": -0.001}}}},
        "hardware.gpu.time_correction.beta",
    ),
    (
        "override",
        {"hardware": {"gpu": {"scheduler": {"max_num_seqs": 0}}}},
        "hardware.gpu.scheduler.max_num_seqs",
    ),
    ("window", {"model": {"layers": [attention(window=-1)]}}, "model.layers[0].window"),
    ("attention_count", {"model": {"layers": [attention(count=0)]}}, "model.layers[0].count"),
    (
        "linear_count",
        {"model": {"layers": [attention(), {"kind": "linear", "count": 0, "state_bytes": 8}]}},
        "model.layers[1].count",
    ),
    ("heads", {"model": {"layers": [attention(heads=0)]}}, "model.layers[0].heads"),
    ("kv_heads", {"model": {"layers": [attention(kv_heads=0)]}}, "model.layers[0].kv_heads"),
    (
        "resident_below_active",
        {
            "model": {
                "weights": [{"precision": "bf16", "active_params": 2e9, "resident_params": 1e9}]
            }
        },
        "model.weights[0].resident_params",
    ),
    (
        "routed_experts",
        {
            "model": {
                "weights": [
                    {
                        "precision": "bf16",
                        "active_params": 1e9,
                        "resident_params": 4e9,
                        "routing": {"routed_experts": 0, "experts_per_tok": 2, "moe_layers": 4},
                    }
                ]
            }
        },
        "model.weights[0].routing.routed_experts",
    ),
    ("policy", {"scheduler": {"policy": "lifo"}}, "scheduler.policy"),
    ("router", {"hardware": {"gpu": {"router": "least_busy"}}}, "hardware.gpu.router"),
    (
        "weight_precision",
        {
            "model": {
                "weights": [{"precision": "int8", "active_params": 1e9, "resident_params": 1e9}]
            }
        },
        "model.weights[0].precision",
    ),
    (
        "attention_precision",
        {"model": {"attention_precision": "int4"}},
        "model.attention_precision",
    ),
    (
        "kv_precision",
        {"model": {"layers": [attention(kv_precision="fp6")]}},
        "model.layers[0].kv_precision",
    ),
    ("layer_kind", {"model": {"layers": [attention(kind="mamba")]}}, "model.layers[0].kind"),
]


@pytest.mark.parametrize(
    ("changes", "key_path"), [c[1:] for c in BAD_RANGES], ids=[c[0] for c in BAD_RANGES]
)
def test_out_of_range_value_is_a_load_error(
    tmp_path: Path, changes: dict[str, Any], key_path: str
) -> None:
    """Every range and enumeration rule of docs/configuration.md is checked at load time, and the error
    names the key."""
    assert_names(tmp_path, merge(dense_config(), changes), key_path)


@pytest.mark.parametrize(
    "changes",
    [
        {"scheduler": {"gpu_memory_utilization": 1.0, "max_waiting": 0}},
        {"scheduler": {"long_prefill_token_threshold": 0, "kv_cache_capacity": 0}},
        {"model": {"layers": [attention(), attention(window=1)]}},
        {"hardware": {"gpu": {"time_correction": {"alpha": 0.01, "beta": 0.0}}}},
    ],
)
def test_boundary_values_are_accepted(tmp_path: Path, changes: dict[str, Any]) -> None:
    """The inclusive ends of the ranges (utilization 1, zeros where >= 0 is allowed) load."""
    assert "gpu" in load(tmp_path, merge(dense_config(), changes)).deployments


# ---------------------------------------------------------------------------------------
# parallelism, fabric, profiles, precisions, fit


def test_tp_not_divisible_by_ep_is_an_error(tmp_path: Path) -> None:
    """``tp % ep != 0`` (tp 4, ep 3) is a load error on the entry."""
    assert_names(tmp_path, dense_config(hardware={"gpu": {"tp": 4, "ep": 3}}), "hardware.gpu.ep")


def test_ep_dividing_tp_loads(tmp_path: Path) -> None:
    """tp 4 with ep 2 (ep divides tp) loads."""
    cfg = load(tmp_path, dense_config(hardware={"gpu": {"tp": 4, "ep": 2}}))
    assert (cfg.deployments["gpu"].hardware.tp, cfg.deployments["gpu"].hardware.ep) == (4, 2)


def test_tp_above_one_needs_a_fabric(tmp_path: Path) -> None:
    """``tp = 2`` on a profile without ``[fabric]`` is an error naming the entry's tp."""
    prof = merge(gpu_profile(), {"fabric": DELETE})
    path, message = load_error(tmp_path, dense_config(hardware={"gpu": {"tp": 2}}), {"gpu": prof})
    assert message.startswith(f"{path}: hardware.gpu.tp:"), message
    assert "fabric" in message


def test_tp_one_needs_no_fabric(tmp_path: Path) -> None:
    """A profile without ``[fabric]`` is fine for tp = 1."""
    prof = merge(gpu_profile(), {"fabric": DELETE})
    cfg = load(tmp_path, dense_config(), {"gpu": prof})
    assert cfg.deployments["gpu"].profile.fabric is None


def test_tp_wider_than_a_node_needs_scale_out(tmp_path: Path) -> None:
    """tp 8 on a 4-GPU node without ``scale_out`` is an error; with it, it loads."""
    prof = merge(gpu_profile(), {"fabric": {"scale_out": DELETE}})
    config = dense_config(hardware={"gpu": {"tp": 8}})
    path, message = load_error(tmp_path, config, {"gpu": prof})
    assert message.startswith(f"{path}: hardware.gpu.tp:"), message
    assert "scale_out" in message
    ok_dir = tmp_path / "ok"
    ok_dir.mkdir()
    assert load(ok_dir, config).deployments["gpu"].hardware.tp == 8
    node_dir = tmp_path / "node"
    node_dir.mkdir()
    node = dense_config(hardware={"gpu": {"tp": 4}})
    assert load(node_dir, node, {"gpu": prof}).deployments["gpu"].hardware.tp == 4


def test_missing_hardware_profile_is_an_error(tmp_path: Path) -> None:
    """``[hardware.nope]`` without ``hardware_profiles/nope.toml`` is an error naming the
    entry and the missing file."""
    path, message = load_error(tmp_path, dense_config(hardware={"nope": {}}))
    assert message.startswith(f"{path}: hardware.nope:"), message
    assert "nope.toml" in message


@pytest.mark.parametrize(
    ("changes", "precision", "key_path"),
    [
        (
            {"weights": [{"precision": "fp4", "active_params": 1e9, "resident_params": 1e9}]},
            "fp4",
            "model.weights[0].precision",
        ),
        ({"attention_precision": "fp8"}, "fp8", "model.attention_precision"),
        ({"attention_precision": "fp32"}, "fp32", "model.attention_precision"),
    ],
)
def test_precision_without_a_flop_rate_is_an_error_naming_both(
    tmp_path: Path, changes: dict[str, Any], precision: str, key_path: str
) -> None:
    """A precision the model uses but the profile has no FLOP rate for (fp4/fp8 on an
    Ampere-like profile; fp32 without fp16) is an error naming the precision and the
    profile."""
    prof = merge(
        gpu_profile(),
        {"flops_fp4": DELETE, "flops_fp8": DELETE}
        | ({"flops_fp16": DELETE} if precision == "fp32" else {}),
    )
    config = dense_config(model=changes, hardware={"ampere": {}, "gpu": DELETE})
    path, profiles_dir = write_setup(tmp_path, config, {"ampere": prof})
    message = config_error(load_model_config, path, profiles_dir)
    assert message.startswith(f"{path}: {key_path}:"), message
    assert precision in message
    assert "ampere" in message


def test_weights_that_do_not_fit_are_an_error(tmp_path: Path) -> None:
    """95 GB of bf16 weights exceed 100 GB × 0.9: a load error on the entry."""
    big = {"weights": [{"precision": "bf16", "active_params": 1e9, "resident_params": 47.5e9}]}
    path, message = load_error(tmp_path, dense_config(model=big))
    assert message.startswith(f"{path}: hardware.gpu:"), message
    assert "fit" in message


def test_weights_that_do_not_fit_load_with_an_explicit_kv_capacity(tmp_path: Path) -> None:
    """With ``kv_cache_capacity`` given, the fit check is skipped and that capacity is used."""
    big = {"weights": [{"precision": "bf16", "active_params": 1e9, "resident_params": 47.5e9}]}
    dep = load(
        tmp_path, dense_config(model=big, scheduler={"kv_cache_capacity": 1_000_000})
    ).deployments["gpu"]
    assert dep.kv_bytes == 1_000_000
    assert dep.total_blocks == 1_000_000 // (4 * 512 * 16)


def test_weights_fit_across_tp_gpus(tmp_path: Path) -> None:
    """The memory pool is ``memory_capacity · tp · gpu_memory_utilization``: 95 GB of weights
    fit on tp = 2, and the KV bytes are the rest of the pool."""
    big = {"weights": [{"precision": "bf16", "active_params": 1e9, "resident_params": 47.5e9}]}
    dep = load(tmp_path, dense_config(model=big, hardware={"gpu": {"tp": 2}})).deployments["gpu"]
    assert dep.kv_bytes == 180_000_000_000 - 95_000_000_000


def test_kv_bytes_floor_the_pool_and_each_stream(tmp_path: Path) -> None:
    """kv_bytes = floor(capacity · tp · utilization) − Σ floor(resident · b): with a pool of
    90,000,000,000.9 B and 1e9 + 1 fp4 parameters (500,000,000.5 B) it is 89,500,000,000."""
    fp4 = {"weights": [{"precision": "fp4", "active_params": 1e9, "resident_params": 1e9 + 1}]}
    dep = load(
        tmp_path,
        dense_config(model=fp4),
        {"gpu": gpu_profile(memory_capacity=100_000_000_001)},
    ).deployments["gpu"]
    assert dep.model.resident_weight_bytes == 500_000_000
    assert dep.kv_bytes == 89_500_000_000


def test_kv_smaller_than_one_block_is_an_error(tmp_path: Path) -> None:
    """A KV cache below one block (explicit capacity, or what the weights leave) fails."""
    block = 4 * 512 * 16
    path, message = load_error(tmp_path, dense_config(scheduler={"kv_cache_capacity": block - 1}))
    assert message.startswith(f"{path}: hardware.gpu:"), message
    exact_dir = tmp_path / "exact"
    exact_dir.mkdir()
    exact = load(exact_dir, dense_config(scheduler={"kv_cache_capacity": block}))
    assert exact.deployments["gpu"].total_blocks == 1
    # the weights leave 1000 bytes of the 90 GB pool
    tight = {
        "weights": [{"precision": "bf16", "active_params": 1e9, "resident_params": 44_999_999_500}]
    }
    tight_dir = tmp_path / "tight"
    tight_dir.mkdir()
    path, message = load_error(tight_dir, dense_config(model=tight))
    assert message.startswith(f"{path}: hardware.gpu:"), message


@pytest.mark.parametrize(
    "layers",
    [
        [attention(window=128)],
        [{"kind": "linear", "count": 4, "state_bytes": 1024}],
        [attention(window=4096), {"kind": "linear", "count": 4, "state_bytes": 1024}],
    ],
    ids=["windowed_only", "linear_only", "windowed_and_linear"],
)
def test_model_without_full_context_attention_is_an_error(
    tmp_path: Path, layers: list[dict[str, Any]]
) -> None:
    """A model needs at least one full-context attention class (it defines the KV block)."""
    assert_names(tmp_path, dense_config(model={"layers": layers}), "model.layers", "full-context")


def test_fault_table_with_an_unknown_mode_names_the_key(tmp_path: Path) -> None:
    """A ``[fault]`` table is validated at load: an unknown mode is an error naming
    ``fault.mode``."""
    path, message = load_error(tmp_path, dense_config(fault={"mode": "disconnect"}))
    assert message.startswith(f"{path}: fault.mode:"), message


@pytest.mark.parametrize(
    ("changes", "key_path"),
    [
        ({"scheduler": DELETE}, "scheduler"),
        ({"model": DELETE}, "model"),
        ({"hardware": DELETE}, "hardware"),
        ({"model": {"name": DELETE}}, "model.name"),
        ({"model": {"weights": DELETE}}, "model.weights"),
        ({"model": {"layers": DELETE}}, "model.layers"),
        ({"scheduler": {"max_num_seqs": DELETE}}, "scheduler.max_num_seqs"),
        ({"scheduler": {"max_num_batched_tokens": DELETE}}, "scheduler.max_num_batched_tokens"),
        ({"model": {"layers": [{"kind": "attention", "count": 4}]}}, "model.layers[0].heads"),
    ],
)
def test_missing_required_table_or_key_is_an_error(
    tmp_path: Path, changes: dict[str, Any], key_path: str
) -> None:
    """A missing required table or key is an error naming it."""
    assert_names(tmp_path, merge(dense_config(), changes), key_path)


def test_empty_hardware_table_is_an_error(tmp_path: Path) -> None:
    """A config needs at least one ``[hardware.<name>]`` entry."""
    text = dumps(dense_config(hardware=DELETE)) + "\n[hardware]\n"
    assert_names(tmp_path, text, "hardware")


def test_invalid_toml_is_an_error_naming_the_file(tmp_path: Path) -> None:
    """A syntax error is a one-line ConfigError starting with the file's path."""
    path, message = load_error(tmp_path, "[model\nname = ")
    assert message.startswith(f"{path}:"), message


def test_toml_nested_past_the_parser_is_an_error_naming_the_file(tmp_path: Path) -> None:
    """Arrays nested 100,000 deep (a RecursionError traceback in tomllib) are one line."""
    path, message = load_error(tmp_path, "a = " + "[" * 100_000 + "]" * 100_000 + "\n")
    assert message == f"{path}: invalid TOML: nested too deep", message


def test_missing_config_file_is_an_error(tmp_path: Path) -> None:
    """A config path that does not exist is a ConfigError naming it."""
    message = config_error(load_model_config, tmp_path / "absent.toml", tmp_path)
    assert message.startswith(f"{tmp_path / 'absent.toml'}:"), message


# ---------------------------------------------------------------------------------------
# whole-file validation and entry selection


def two_entries(bad: dict[str, Any]) -> dict[str, Any]:
    return dense_config(hardware={"gpu": {}, "bad": bad})


@pytest.mark.parametrize(
    "bad",
    [{"tp": 4, "ep": 3}, {"tp": 8, "scheduler": {"max_num_seqs": 0}}, {"replicas": 0}],
    ids=["tp_ep", "override_range", "replicas"],
)
def test_one_bad_entry_invalidates_the_whole_file(tmp_path: Path, bad: dict[str, Any]) -> None:
    """A config is valid as a whole or not at all: asking for the good entry still fails,
    naming the bad one."""
    path, profiles_dir = write_setup(
        tmp_path, two_entries(bad), {"gpu": gpu_profile(), "bad": gpu_profile()}
    )
    message = config_error(load_deployment, path, "gpu", profiles_dir)
    assert message.startswith(f"{path}: hardware.bad"), message
    config_error(load_model_config, path, profiles_dir)


def test_bad_profile_of_another_entry_invalidates_the_whole_file(tmp_path: Path) -> None:
    """An entry whose profile is missing fails the file even when another entry is asked for."""
    path, profiles_dir = write_setup(tmp_path, two_entries({}), {"gpu": gpu_profile()})
    message = config_error(load_deployment, path, "gpu", profiles_dir)
    assert "hardware.bad" in message


def test_select_deployment_by_name_and_alone(tmp_path: Path) -> None:
    """``select_deployment`` returns the named entry; with None, the only entry."""
    path, profiles_dir = write_setup(tmp_path, dense_config())
    cfg = load_model_config(path, profiles_dir)
    assert select_deployment(cfg, "gpu").hardware_name == "gpu"
    assert select_deployment(cfg, None).hardware_name == "gpu"
    assert load_deployment(path, None, profiles_dir).hardware_name == "gpu"


def test_unknown_hardware_name_is_an_error(tmp_path: Path) -> None:
    """Asking for an entry the file does not have is an error naming it and the choices."""
    path, profiles_dir = write_setup(tmp_path, dense_config())
    cfg = load_model_config(path, profiles_dir)
    for message in (
        config_error(select_deployment, cfg, "h100"),
        config_error(load_deployment, path, "h100", profiles_dir),
    ):
        assert message.startswith(f"{path}: hardware.h100"), message
        assert "gpu" in message


def test_no_hardware_name_with_several_entries_is_ambiguous(tmp_path: Path) -> None:
    """With several entries, ``hardware=None`` is an error listing them."""
    path, profiles_dir = write_setup(
        tmp_path,
        dense_config(hardware={"gpu": {}, "other": {}}),
        {"gpu": gpu_profile(), "other": gpu_profile()},
    )
    cfg = load_model_config(path, profiles_dir)
    for message in (
        config_error(select_deployment, cfg, None),
        config_error(load_deployment, path, None, profiles_dir),
    ):
        assert message.startswith(f"{path}: hardware"), message
        assert "gpu" in message and "other" in message


# ---------------------------------------------------------------------------------------
# workloads


def write_workload(tmp_path: Path, **changes: Any) -> Path:
    base: dict[str, Any] = {
        "arrival_pattern": "poisson",
        "num_requests": 10,
        "input_len_dist": {"type": "fixed", "value": 100},
        "output_len_dist": {"type": "uniform", "min": 1, "max": 10},
        "seed": 1,
    }
    for key, value in changes.items():
        if value is DELETE:
            del base[key]
        else:
            base[key] = value
    path = tmp_path / "workload.toml"
    path.write_text(dumps(base))
    return path


def test_workload_defaults(tmp_path: Path) -> None:
    """A workload giving only required keys gets arrival_rate 1.0, no users, jitter 0."""
    w = load_workload(write_workload(tmp_path))
    assert w.arrival_rate == 1.0
    assert w.num_concurrent_users is None
    assert w.closed_loop_jitter_secs == 0
    assert w.duration_secs is None
    assert isinstance(w.input_len_dist, FixedDist)
    assert isinstance(w.output_len_dist, UniformDist)


@pytest.mark.parametrize("path", sorted(WORKLOADS.glob("*.toml")), ids=lambda p: p.stem)
def test_each_shipped_workload_loads(path: Path) -> None:
    """Every ``configs/workloads/*.toml`` loads and says how many requests or how long."""
    w = load_workload(path)
    assert w.num_requests is not None or w.duration_secs is not None


@pytest.mark.parametrize(
    ("changes", "key_path"),
    [
        ({"arrival_pattern": "closed_loop"}, "num_concurrent_users"),
        ({"num_requests": DELETE}, "num_requests"),
        ({"input_len_dist": {"type": "zipf", "value": 3}}, "input_len_dist.type"),
        (
            {"output_len_dist": {"type": "fixed", "value": 3, "std_dev": 1}},
            "output_len_dist.std_dev",
        ),
        ({"arrival_pattern": "bursty"}, "arrival_pattern"),
        ({"seed": -1}, "seed"),
        ({"num_requests": 2.5}, "num_requests"),
        ({"arrival_rate": 0}, "arrival_rate"),
        ({"nm_requests": 3}, "nm_requests"),
    ],
    ids=[
        "closed_loop_without_users",
        "neither_count_nor_duration",
        "unknown_dist",
        "unknown_dist_key",
        "unknown_pattern",
        "negative_seed",
        "float_count",
        "zero_rate",
        "unknown_key",
    ],
)
def test_invalid_workload_is_an_error_naming_the_key(
    tmp_path: Path, changes: dict[str, Any], key_path: str
) -> None:
    """Workload validation errors are one line: ``<file>: <key path>: ...``."""
    path = write_workload(tmp_path, **changes)
    message = config_error(load_workload, path)
    assert message.startswith(f"{path}: {key_path}"), message


def test_closed_loop_with_users_and_duration_only_loads(tmp_path: Path) -> None:
    """A closed loop with its users and only a duration is valid."""
    path = write_workload(
        tmp_path,
        arrival_pattern="closed_loop",
        num_concurrent_users=4,
        num_requests=DELETE,
        duration_secs=30,
    )
    w = load_workload(path)
    assert (w.num_concurrent_users, w.num_requests, w.duration_secs) == (4, None, 30.0)


DISTS = [
    FixedDist(value=3.7),
    UniformDist(min=1, max=3),
    NormalDist(mean=0.5, std_dev=3.0),
    LognormalDist(mean=0.0, std_dev=1.5),
]


@pytest.mark.parametrize("dist", DISTS, ids=lambda d: d.type)
def test_length_samples_are_floored_ints_at_least_one_and_seeded(dist: Any) -> None:
    """``sample`` returns int64 values >= 1, and the same seed gives the same values."""
    a = dist.sample(np.random.default_rng(7), 2000)
    b = dist.sample(np.random.default_rng(7), 2000)
    c = dist.sample(np.random.default_rng(8), 2000)
    assert a.shape == (2000,)
    assert a.dtype == np.int64
    assert a.min() >= 1
    assert np.array_equal(a, b)
    if dist.type != "fixed":
        assert not np.array_equal(a, c)


def test_fixed_dist_is_floored() -> None:
    """A fixed 3.7 samples as 3 (floored, not rounded)."""
    assert set(FixedDist(value=3.7).sample(np.random.default_rng(0), 10).tolist()) == {3}


def test_uniform_dist_is_inclusive() -> None:
    """uniform(min, max) draws every integer of [min, max], both ends included."""
    draws = UniformDist(min=1, max=3).sample(np.random.default_rng(0), 500)
    assert set(draws.tolist()) == {1, 2, 3}


@pytest.mark.parametrize(
    ("dist", "draw"),
    [
        (NormalDist(mean=0.5, std_dev=3.0), lambda rng: rng.normal(0.5, 3.0, size=2000)),
        (LognormalDist(mean=2.0, std_dev=1.5), lambda rng: rng.lognormal(2.0, 1.5, size=2000)),
    ],
    ids=["normal", "lognormal"],
)
def test_continuous_dists_are_floored_then_clamped(dist: Any, draw: Any) -> None:
    """normal / lognormal samples are ``max(floor(x), 1)`` of the seeded numpy draw, and the
    lognormal's parameters are those of the underlying normal."""
    got = dist.sample(np.random.default_rng(11), 2000)
    raw = draw(np.random.default_rng(11))
    assert np.array_equal(got, np.maximum(np.floor(raw), 1).astype(np.int64))
    assert (raw < 1).any()  # the clamp was exercised


def test_dists_from_toml_sample_like_their_classes(tmp_path: Path) -> None:
    """Length distributions read from a workload file are the tagged classes with their
    parameters."""
    path = write_workload(
        tmp_path,
        input_len_dist={"type": "lognormal", "mean": 6, "std_dev": 0.5},
        output_len_dist={"type": "normal", "mean": 100, "std_dev": 10},
    )
    w = load_workload(path)
    assert w.input_len_dist == LognormalDist(mean=6.0, std_dev=0.5)
    assert w.output_len_dist == NormalDist(mean=100.0, std_dev=10.0)


# ---------------------------------------------------------------------------------------
# [model].tokenizer


def test_tokenizer_path_is_resolved_against_the_config_file(tmp_path: Path) -> None:
    """``[model].tokenizer`` is written relative to the config file and loads as the
    resolved path of a file that exists."""
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    cfg = load(tmp_path, dense_config(model={"tokenizer": "tok/tokenizer.json"}))
    assert cfg.model.tokenizer == str(tmp_path / "tok" / "tokenizer.json")
    assert cfg.deployments["gpu"].model.tokenizer == cfg.model.tokenizer
    assert load(tmp_path, dense_config()).model.tokenizer is None


@pytest.mark.parametrize(
    ("value", "fragment"),
    [("missing.json", "no such file or directory"), ("", "must be a non-empty path")],
)
def test_tokenizer_that_is_missing_is_a_one_line_error(
    tmp_path: Path, value: str, fragment: str
) -> None:
    """A tokenizer path that does not exist (or is empty) fails the load, naming the key."""
    message = assert_names(
        tmp_path, dense_config(model={"tokenizer": value}), "model.tokenizer", fragment
    )
    assert "\n" not in message


# ---------------------------------------------------------------------------------------
# prefix caching and the cache-aware routers


def test_prefix_caching_defaults_on_and_router_options_default(tmp_path: Path) -> None:
    """enable_prefix_caching defaults to true (as in vLLM); the routers' options default
    to affinity_load_ratio 1.25 and kv_aware_queue_weight 1.0."""
    dep = load(tmp_path, dense_config()).deployments["gpu"]
    assert dep.scheduler.enable_prefix_caching is True
    assert (dep.hardware.affinity_load_ratio, dep.hardware.kv_aware_queue_weight) == (1.25, 1.0)


def test_prefix_caching_and_routers_are_configurable(tmp_path: Path) -> None:
    """enable_prefix_caching per scheduler (and per hardware entry's override); the two
    cache-aware routers with their options, case-insensitively."""
    cfg = load(
        tmp_path,
        dense_config(
            scheduler={"enable_prefix_caching": False},
            hardware={
                "gpu": {
                    "replicas": 4,
                    "router": "Prefix_Affinity",
                    "affinity_load_ratio": 2,
                    "scheduler": {"enable_prefix_caching": True},
                }
            },
        ),
    )
    dep = cfg.deployments["gpu"]
    assert cfg.scheduler.enable_prefix_caching is False
    assert dep.scheduler.enable_prefix_caching is True
    assert (dep.hardware.router, dep.hardware.affinity_load_ratio) == ("prefix_affinity", 2.0)
    (tmp_path / "kv").mkdir()
    kv = load(
        tmp_path / "kv",
        dense_config(hardware={"gpu": {"router": "kv_aware", "kv_aware_queue_weight": 0}}),
    )
    assert kv.deployments["gpu"].hardware.kv_aware_queue_weight == 0


@pytest.mark.parametrize(
    ("changes", "key", "fragment"),
    [
        (
            {"scheduler": {"enable_prefix_caching": "yes"}},
            "scheduler.enable_prefix_caching",
            "must be",
        ),
        (
            {"hardware": {"gpu": {"affinity_load_ratio": 0.5}}},
            "hardware.gpu.affinity_load_ratio",
            "must be >= 1",
        ),
        (
            {"hardware": {"gpu": {"kv_aware_queue_weight": -1}}},
            "hardware.gpu.kv_aware_queue_weight",
            "must be >= 0",
        ),
        (
            {"hardware": {"gpu": {"router": "least_busy"}}},
            "hardware.gpu.router",
            "round_robin, least_loaded, prefix_affinity, kv_aware, random, session_affinity",
        ),
    ],
)
def test_prefix_caching_keys_are_validated(
    tmp_path: Path, changes: dict[str, Any], key: str, fragment: str
) -> None:
    path, message = load_error(tmp_path, dense_config(**changes))
    assert message.startswith(f"{path}: {key}: ")
    assert fragment in message


@pytest.mark.parametrize(
    ("value", "fragment"), [("-0.001", "must be >= 0"), ("61", "must be <= 60"), ("nan", "nan")]
)
def test_frontend_latency_is_range_checked_nan_included(
    tmp_path: Path, value: str, fragment: str
) -> None:
    """``[scheduler] frontend_latency`` is seconds in 0..60; NaN fails the bounds too (a
    comparison with NaN is false, so a bound must be checked as ``not value >= lo``)."""
    text = dumps(dense_config(scheduler={"frontend_latency": 0.5}))
    assert "frontend_latency = 0.5" in text
    path, message = load_error(
        tmp_path, text.replace("frontend_latency = 0.5", f"frontend_latency = {value}")
    )
    assert message.startswith(f"{path}: scheduler.frontend_latency: ")
    assert fragment in message


def test_a_frontend_latency_loads_into_the_scheduler(tmp_path: Path) -> None:
    cfg = load(tmp_path, dense_config(scheduler={"frontend_latency": 0.002}))
    assert cfg.scheduler.frontend_latency == 0.002


def test_the_config_package_reexports_every_public_name() -> None:
    """``inference_lab.core.config`` re-exports each name its modules export (the
    field checks excepted), the very objects, so ``from inference_lab.core.config import
    X`` reaches anything the package offers."""
    import importlib

    import inference_lab.core.config as facade

    names: set[str] = set()
    for module in ("model", "speculative", "scheduler", "hardware", "deployment", "fault",
                   "workload", "convert", "loading", "disaggregation", "lora", "workload_files"):  # fmt: skip
        mod = importlib.import_module(f"inference_lab.core.config.{module}")
        names |= set(mod.__all__)
        for name in mod.__all__:
            assert getattr(facade, name) is getattr(mod, name), name
    assert set(facade.__all__) == names
    assert {"load_deployment", "load_model_config", "load_workload", "Deployment"} <= names
