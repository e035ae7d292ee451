"""The shipped files: every model config loads with every hardware entry, the architectures
and hardware profiles carry the published numbers, the workloads load.

The tables below (``ARCHITECTURES``, ``PROFILE_TABLE``, ``WORKLOAD_TABLE``) are the
reference: the models' published architectures, the GPUs' datasheet figures and the
documented workloads, written out once here so that an edit to a shipped file that changes
a number fails a test."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inference_lab.core.config import (
    AttentionLayer,
    ExponentialTime,
    FixedDist,
    FixedTime,
    SessionConfig,
    UniformDist,
    load_deployment,
    load_hardware_profile,
    load_model_config,
    load_workload,
)
from inference_lab.core.roofline import Roofline
from tests.configs_util import CONFIGS, GPT_OSS_20B, PROFILES, WORKLOADS

#: the served models (configs/) and the fidelity page's (configs/fidelity/)
MODEL_FILES = sorted(CONFIGS.glob("*.toml")) + sorted((CONFIGS / "fidelity").glob("*.toml"))
ENTRIES = [
    (path, name)
    for path in MODEL_FILES
    for name in tomllib.loads(path.read_text()).get("hardware", {})
]


def test_the_documented_models_are_shipped() -> None:
    """configs/ holds one file per documented model, named after the model."""
    names = {load_model_config(p, PROFILES).model.name: p.stem for p in MODEL_FILES}
    assert set(names) == set(ARCHITECTURES)
    assert all(stem == name for name, stem in names.items())


@pytest.mark.parametrize(("path", "hardware"), ENTRIES, ids=[f"{p.stem}-{h}" for p, h in ENTRIES])
def test_every_shipped_entry_loads_and_prices_a_step(path: Path, hardware: str) -> None:
    """Each ``[hardware.x]`` of each shipped config loads (profile found, precisions have
    rates, weights fit, at least one KV block), and its roofline prices a decode step."""
    dep = load_deployment(path, hardware, PROFILES)
    assert dep.hardware_name == hardware
    assert dep.total_blocks >= 1
    t = Roofline(dep).step_time(np.ones(4, dtype=np.int64), np.full(4, 100, dtype=np.int64))
    assert 0 < t < 1


def test_shipped_configs_find_their_profiles_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``profiles_dir``, a config under configs/ finds ../hardware_profiles."""
    monkeypatch.delenv("INFERENCE_LAB_HARDWARE_PROFILES", raising=False)
    monkeypatch.chdir("/")
    assert load_deployment(GPT_OSS_20B, "b200").profile.name == "NVIDIA B200"


#: vLLM's own limit of sequences per step on a GPU of 70 GiB or more
#: (vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults), which the vLLM-calibrated
#: entries (``*-vllm``) carry.
VLLM_MAX_NUM_SEQS = 1024


def max_num_seqs(name: str) -> int:
    return VLLM_MAX_NUM_SEQS if name.endswith("-vllm") else 256


def test_gpt_oss_20b_entries_and_scheduler() -> None:
    """gpt-oss-20b runs on exactly b200, b300, h200 and gh200, all at tp = 1, with
    max_num_batched_tokens 8192, max_num_seqs 256, fcfs, block_size 64; and on the
    vLLM-calibrated h100-vllm, h200-vllm and b200-vllm, at vLLM's 1,024 sequences."""
    cfg = load_model_config(GPT_OSS_20B, PROFILES)
    vllm = {"h100-vllm", "h200-vllm", "b200-vllm"}
    assert set(cfg.deployments) == {"b200", "b300", "h200", "gh200"} | vllm
    for name, dep in cfg.deployments.items():
        assert dep.hardware.tp == 1
        s = dep.scheduler
        assert (s.max_num_batched_tokens, s.max_num_seqs, s.policy, s.block_size) == (
            8192,
            max_num_seqs(name),
            "fcfs",
            64,
        )


@pytest.mark.parametrize("path", [p for p in MODEL_FILES if p != GPT_OSS_20B], ids=lambda p: p.stem)
def test_other_models_scheduler(path: Path) -> None:
    """The other shipped models use max_num_batched_tokens 8192, max_num_seqs 256 (vLLM's
    1,024 on the vLLM-calibrated entries), block_size 16 on every entry."""
    for name, dep in load_model_config(path, PROFILES).deployments.items():
        s = dep.scheduler
        assert (s.max_num_batched_tokens, s.max_num_seqs, s.block_size) == (
            8192,
            max_num_seqs(name),
            16,
        )


def test_llama_70b_tensor_parallelism() -> None:
    """Llama-3-70B (140 GB of bf16) needs tp >= 2 on h100/h200 and runs at tp = 1 on b200."""
    deps = load_model_config(CONFIGS / "Llama-3-70B.toml", PROFILES).deployments
    assert deps["b200"].hardware.tp == 1
    assert deps["h100"].hardware.tp >= 2
    assert deps["h200"].hardware.tp >= 2


# ---------------------------------------------------------------------------------------
# architectures

W = tuple[str, float, float, tuple[int, int, int] | None]  # precision, active, resident, routing
L = tuple[int, int, int, int, int]  # count, heads, head_dim, kv_heads, window

ARCHITECTURES: dict[str, tuple[int, int, list[W], list[L]]] = {
    "gpt-oss-20b": (
        2880,
        131072,
        [
            ("fp4", 2_388_787_200, 19_110_297_600, (32, 4, 24)),
            ("bf16", 1_218_355_200, 1_797_488_640, None),
        ],
        [(12, 64, 64, 8, 128), (12, 64, 64, 8, 0)],
    ),
    "gpt-oss-120b": (
        2880,
        131072,
        [
            ("fp4", 3_583_180_800, 114_661_785_600, (128, 4, 36)),
            ("bf16", 1_547_919_360, 2_127_052_800, None),
        ],
        [(18, 64, 64, 8, 128), (18, 64, 64, 8, 0)],
    ),
    "Llama-3.1-8B-Instruct": (
        4096,
        131072,
        [("bf16", 8.03e9, 8.03e9, None)],
        [(32, 32, 128, 8, 0)],
    ),
    "Llama-3-70B": (8192, 8192, [("bf16", 70e9, 70e9, None)], [(80, 64, 128, 8, 0)]),
    "Qwen3-30B-A3B": (
        2048,
        40960,
        [("bf16", 3.34e9, 30.5e9, (128, 8, 48))],
        [(48, 32, 128, 4, 0)],
    ),
    "Qwen3-14B-FP8": (
        5120,
        40960,
        [("fp8", 13_212_057_600, 13_212_057_600, None), ("bf16", 777_912_320, 1_555_824_640, None)],
        [(40, 40, 128, 8, 0)],
    ),
    "Llama-3.1-8B-Instruct-FP8": (
        4096,
        131072,
        [("fp8", 6_979_321_856, 6_979_321_856, None), ("bf16", 525_602_816, 1_050_939_392, None)],
        [(32, 32, 128, 8, 0)],
    ),
    "Llama-3.3-70B-Instruct-FP8": (
        8192,
        131072,
        [
            ("fp8", 68_451_041_280, 68_451_041_280, None),
            ("bf16", 1_051_992_064, 2_102_665_216, None),
        ],
        [(80, 64, 128, 8, 0)],
    ),
    "Llama-3.3-70B-Instruct-FP4": (
        8192,
        131072,
        [
            ("fp4", 68_451_041_280, 68_451_041_280, None),
            ("bf16", 1_051_992_064, 2_102_665_216, None),
        ],
        [(80, 64, 128, 8, 0)],
    ),
    "Qwen3-14B": (
        5120,
        40960,
        [("bf16", 13_989_969_920, 14_767_882_240, None)],
        [(40, 40, 128, 8, 0)],
    ),
    "Qwen3-32B": (
        5120,
        40960,
        [("bf16", 31_984_210_944, 32_762_123_264, None)],
        [(64, 64, 128, 8, 0)],
    ),
    # GLM-4.5's architecture: 92 layers (3 dense), 160 + 1 experts of 1536, 8 routed active
    "GLM-4.6-FP8": (
        5120,
        202752,
        [
            ("fp8", 32_005_160_960, 351_170_723_840, (160, 8, 89)),
            ("bf16", 851_158_944, 1_627_105_184, None),
        ],
        [(92, 96, 128, 8, 0)],
    ),
}
#: The KV cache's precision where it is not bf16 (the FP8 / FP4 checkpoints keep it in FP8).
KV_PRECISION = {
    "GLM-4.6-FP8": "fp8",
    "Llama-3.1-8B-Instruct-FP8": "fp8",
    "Llama-3.3-70B-Instruct-FP8": "fp8",
    "Llama-3.3-70B-Instruct-FP4": "fp8",
}


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_model_architecture_matches_the_reference_table(name: str) -> None:
    """Each shipped model has the ARCHITECTURES table's hidden size, context, weight
    streams and layer classes (all attention, K and V stored separately, in bf16 unless
    KV_PRECISION says otherwise)."""
    hidden, max_seq_len, weights, layers = ARCHITECTURES[name]
    (path,) = [p for p in MODEL_FILES if p.stem == name]
    model = load_model_config(path, PROFILES).model
    assert model.name == name
    assert (model.hidden_dim, model.max_seq_len) == (hidden, max_seq_len)
    assert (model.attention_precision, model.activation_bytes) == ("bf16", 2)
    got_weights = [
        (
            w.precision,
            w.active_params,
            w.resident_params,
            None
            if w.routing is None
            else (w.routing.routed_experts, w.routing.experts_per_tok, w.routing.moe_layers),
        )
        for w in model.weights
    ]
    assert sorted(got_weights, key=str) == sorted(weights, key=str)
    assert all(isinstance(layer, AttentionLayer) for layer in model.layers)
    got_layers = [
        (x.count, x.heads, x.head_dim, x.kv_heads, x.window)
        for x in model.layers
        if isinstance(x, AttentionLayer)
    ]
    assert sorted(got_layers) == sorted(layers)
    kv = KV_PRECISION.get(name, "bf16")
    assert all(
        x.kv_precision == kv and not x.kv_shared
        for x in model.layers
        if isinstance(x, AttentionLayer)
    )


# ---------------------------------------------------------------------------------------
# hardware profiles

PROFILE_TABLE: dict[str, tuple[Any, ...]] = {
    # fp4, fp8, bf16, fp16, bandwidth, capacity, gpus/node, up bw, up lat, up inr, out bw, out lat
    "b200": (9.0e15, 4.5e15, 2.25e15, 2.25e15, 8.0e12, 192e9, 8, 9e11, 5e-6, True, 5e10, 2e-5),
    "b300": (1.35e16, 4.5e15, 2.25e15, 2.25e15, 8.0e12, 288e9, 8, 9e11, 5e-6, True, 1e11, 2e-5),
    "h200": (
        1.979e15,
        1.979e15,
        9.89e14,
        9.89e14,
        4.8e12,
        141e9,
        8,
        4.5e11,
        5e-6,
        True,
        5e10,
        2e-5,
    ),
    "h100": (
        1.979e15,
        1.979e15,
        9.89e14,
        9.89e14,
        3.35e12,
        80e9,
        8,
        4.5e11,
        5e-6,
        True,
        5e10,
        2e-5,
    ),
    "gh200": (
        1.979e15,
        1.979e15,
        9.89e14,
        9.89e14,
        4.0e12,
        96e9,
        4,
        4.5e11,
        5e-6,
        False,
        2.5e10,
        2e-5,
    ),
    "a100": (None, None, 3.12e14, 3.12e14, 2.039e12, 80e9, 8, 3.0e11, 5e-6, False, 2.5e10, 2e-5),
    "mi300x": (
        None,
        2.615e15,
        1.307e15,
        1.307e15,
        5.3e12,
        192e9,
        8,
        4.48e11,
        5e-6,
        False,
        5e10,
        2e-5,
    ),
}


@pytest.mark.parametrize("name", list(PROFILE_TABLE))
def test_hardware_profile_matches_the_reference_table(name: str) -> None:
    """Each shipped profile carries the PROFILE_TABLE's FLOP rates (absent where the table
    has None), bandwidth, capacity and fabric."""
    fp4, fp8, bf16, fp16, bw, cap, gpn, up_bw, up_lat, up_inr, out_bw, out_lat = PROFILE_TABLE[name]
    p = load_hardware_profile(PROFILES / f"{name}.toml")
    assert (p.flops_fp4, p.flops_fp8, p.flops_bf16, p.flops_fp16) == (fp4, fp8, bf16, fp16)
    assert p.flops("fp32") == fp16 / 2
    assert (p.memory_bandwidth, p.memory_capacity) == (bw, cap)
    assert p.fabric is not None and p.fabric.scale_out is not None
    assert p.fabric.gpus_per_node == gpn
    up = p.fabric.scale_up
    assert (up.bandwidth, up.latency, up.in_network_reduction) == (up_bw, up_lat, up_inr)
    out = p.fabric.scale_out
    assert (out.bandwidth, out.latency) == (out_bw, out_lat)


def test_every_shipped_profile_is_documented() -> None:
    """hardware_profiles/ ships the seven documented GPUs and the calibrated profiles."""
    assert {p.stem for p in PROFILES.glob("*.toml")} == set(PROFILE_TABLE) | set(CALIBRATED)


#: The calibrated profiles (docs/fidelity.md): each layered on a datasheet profile, whose
#: numbers it keeps (but the memory of the GPUs measured, where it differs: the DGX B200's
#: 180 GB; nvidia-smi's 81,559 MiB and 143,771 MiB for the H100 and H200 the engines see),
#: with a fitted efficiency (nvidia-smi's 183,359 MiB for the B200 vLLM sees).
CALIBRATED: dict[str, tuple[str, float | None]] = {
    "h100-trtllm": ("h100", None),
    "h200-trtllm": ("h200", None),
    "b200-trtllm": ("b200", 180e9),
    "h100-nim": ("h100", None),
    "h100-vllm": ("h100", 81_559 * 2**20),
    "h200-vllm": ("h200", 143_771 * 2**20),
    "b200-vllm": ("b200", 183_359 * 2**20),
    "h200-sglang": ("h200", 143_771 * 2**20),
    "mi300x-sglang": ("mi300x", None),
}
#: vLLM on Hopper multiplies MXFP4 weights at the BF16 rate (docs/fidelity.md#mxfp4-on-hopper).
FP4_AT_BF16 = {"h100-vllm", "h200-vllm"}


@pytest.mark.parametrize("name", list(CALIBRATED))
def test_calibrated_profiles_keep_their_datasheet_base(name: str) -> None:
    """A calibrated profile names its base, carries the base's datasheet numbers (memory
    apart, where the measured GPUs had less) and a fitted efficiency below the datasheet;
    the base itself sets no efficiency."""
    base_name, memory = CALIBRATED[name]
    p = load_hardware_profile(PROFILES / f"{name}.toml")
    base = load_hardware_profile(PROFILES / f"{base_name}.toml")
    assert p.base == base_name and base.base is None and base.efficiency.is_identity
    assert (p.flops_fp4, p.flops_fp8, p.flops_bf16, p.memory_bandwidth, p.fabric) == (
        base.flops_bf16 if name in FP4_AT_BF16 else base.flops_fp4,
        base.flops_fp8,
        base.flops_bf16,
        base.memory_bandwidth,
        base.fabric,
    )
    assert p.memory_capacity == (base.memory_capacity if memory is None else memory)
    assert not p.efficiency.is_identity
    # the fractions its rows determine (h200-vllm's two rows leave the bandwidth alone)
    assert p.efficiency.memory_bandwidth <= 1 and p.efficiency.flops < 1


# ---------------------------------------------------------------------------------------
# workloads

WORKLOAD_TABLE: dict[str, dict[str, Any]] = {
    "quick": {
        "arrival_pattern": "poisson",
        "arrival_rate": 2.0,
        "num_requests": 50,
        "input": ("lognormal", 6.0, 0.5),
        "output": ("lognormal", 5.0, 0.5),
    },
    "chat-poisson-5rps": {
        "arrival_pattern": "poisson",
        "arrival_rate": 5.0,
        "num_requests": 400,
        "input": ("lognormal", 6.9, 0.7),
        "output": ("lognormal", 5.3, 0.8),
    },
    "chat-closed-64": {
        "arrival_pattern": "closed_loop",
        "num_concurrent_users": 64,
        "closed_loop_jitter_secs": 0.05,
        "num_requests": 2000,
        "input": ("lognormal", 7.0, 0.5),
        "output": ("lognormal", 5.5, 0.8),
    },
    "chat-closed-256": {
        "arrival_pattern": "closed_loop",
        "num_concurrent_users": 256,
        "num_requests": 2000,
        "input": ("lognormal", 7.0, 0.5),
        "output": ("lognormal", 6.5, 0.8),
    },
    "batched-1000": {
        "arrival_pattern": "batched",
        "num_requests": 1000,
        "input": ("fixed", 512),
        "output": ("fixed", 256),
    },
    "long-prompt-4k": {
        "arrival_pattern": "poisson",
        "arrival_rate": 2.0,
        "num_requests": 600,
        "input": ("fixed", 4000),
        "output": ("fixed", 500),
    },
    "chat-sessions-200": {
        "arrival_pattern": "poisson",
        "arrival_rate": 2.0,
        "num_requests": 1600,
        "input": ("lognormal", 5.0, 0.6),
        "output": ("lognormal", 5.3, 0.6),
        "sessions": SessionConfig(
            num_sessions=200,
            turns=FixedDist(value=8),
            think_time=ExponentialTime(mean=5.0),
            system_prompt_tokens=2048,
            shared_system_prompt=True,
        ),
    },
    "agent-loop-32": {
        "arrival_pattern": "closed_loop",
        "num_concurrent_users": 32,
        "num_requests": 3000,
        "input": ("lognormal", 5.5, 0.8),
        "output": ("lognormal", 4.0, 0.5),
        "sessions": SessionConfig(
            num_sessions=100,
            turns=UniformDist(min=10, max=30),
            think_time=FixedTime(value=0.2),
            system_prompt_tokens=4096,
        ),
    },
    "agent-long-context": {
        "arrival_pattern": "closed_loop",
        "num_concurrent_users": 64,
        "num_requests": 2048,
        "input": ("lognormal", 7.1, 0.5),
        "output": ("lognormal", 5.7, 0.5),
        "sessions": SessionConfig(
            num_sessions=128,
            turns=FixedDist(value=16),
            think_time=FixedTime(value=20.0),
            system_prompt_tokens=4096,
        ),
    },
}


def dist_tuple(dist: Any) -> tuple[Any, ...]:
    if dist.type == "fixed":
        return ("fixed", dist.value)
    return (dist.type, dist.mean, dist.std_dev)


def test_the_documented_workloads_are_shipped() -> None:
    """configs/workloads/ holds the documented workloads plus the simulator benchmark."""
    assert {p.stem for p in WORKLOADS.glob("*.toml")} == set(WORKLOAD_TABLE) | {
        "poisson-50rps-4000"
    }


@pytest.mark.parametrize("path", sorted(WORKLOADS.glob("*.toml")), ids=lambda p: p.stem)
def test_shipped_workload_loads_and_samples(path: Path) -> None:
    """Each shipped workload loads and its length distributions sample ints >= 1."""
    w = load_workload(path)
    rng = np.random.default_rng(w.seed)
    for dist in (w.input_len_dist, w.output_len_dist):
        assert dist.sample(rng, 100).min() >= 1


@pytest.mark.parametrize("name", list(WORKLOAD_TABLE))
def test_shipped_workload_matches_the_reference_table(name: str) -> None:
    """Each documented workload has the WORKLOAD_TABLE's pattern, rate or users, count and
    lengths."""
    expected = dict(WORKLOAD_TABLE[name])
    w = load_workload(WORKLOADS / f"{name}.toml")
    assert dist_tuple(w.input_len_dist) == expected.pop("input")
    assert dist_tuple(w.output_len_dist) == expected.pop("output")
    for key, value in expected.items():
        assert getattr(w, key) == value, key
