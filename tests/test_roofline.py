"""The step-cost model: the published reference numbers for gpt-oss-20b
on B200, closed forms for small dense / windowed / linear / MoE models, collectives, KV
capacity and ``blocks_for``.

``reference_step_time`` below is an independent, loop-per-request-per-layer transcription
of the cost model's formulas; the explicit-number tests pin it (and the implementation) to hand
arithmetic.
"""

from __future__ import annotations

import math
import tomllib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inference_lab.core.config import Deployment, load_deployment, load_model_config
from inference_lab.core.roofline import SMALL_BATCH, Roofline, expert_read_fraction
from inference_lab.errors import ConfigError
from tests.configs_util import (
    GPT_OSS_20B,
    PROFILES,
    attention,
    dense_config,
    gpu_profile,
    merge,
    write_setup,
)

B = {"fp4": 0.5, "fp8": 1.0, "bf16": 2.0, "fp16": 2.0, "fp32": 4.0}


def ints(values: Sequence[int]) -> np.ndarray[Any, np.dtype[np.int64]]:
    return np.array(values, dtype=np.int64)


def step(rf: Roofline, n: Sequence[int], c: Sequence[int]) -> float:
    return rf.step_time(ints(n), ints(c))


def build(
    tmp_path: Path, config: Mapping[str, Any], profile: Mapping[str, Any] | None = None
) -> Deployment:
    """The ``gpu`` deployment of ``config`` on ``profile`` (default: ``gpu_profile()``)."""
    sub = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
    sub.mkdir()
    path, profiles_dir = write_setup(sub, config, {"gpu": profile or gpu_profile()})
    return load_model_config(path, profiles_dir).deployments["gpu"]


# ---------------------------------------------------------------------------------------
# an independent transcription of the cost model's formulas


def all_reduce(fabric: Mapping[str, Any], g: int, volume: float) -> float:
    up = fabric["scale_up"]
    k = fabric["gpus_per_node"]
    if g <= k:
        f = 1.0 if up.get("in_network_reduction", False) else 2 * (g - 1) / g
        return up["latency"] + f * volume / up["bandwidth"]
    out = fabric["scale_out"]
    n = math.ceil(g / k)
    f_out = 1.0 if out.get("in_network_reduction", False) else 2 * (n - 1) / n
    return (
        2 * (up["latency"] + (k - 1) / k * volume / up["bandwidth"])
        + out["latency"]
        + f_out * (volume / k) / out["bandwidth"]
    )


def reference_step_time(
    config: Mapping[str, Any],
    profile: Mapping[str, Any],
    n: Sequence[int],
    c: Sequence[int],
    hardware: str = "gpu",
) -> float:
    """The cost model's formulas, one request and one layer at a time."""
    model = config["model"]
    entry = config["hardware"][hardware]
    tp = entry.get("tp", 1)
    tokens = sum(n)
    flops: dict[str, float] = defaultdict(float)
    data: dict[str, float] = defaultdict(float)
    for w in model["weights"]:
        p, active, resident = w["precision"], w["active_params"], w["resident_params"]
        flops[p] += 2 * active * tokens
        r = w.get("routing")
        if r is None or r["routed_experts"] <= r["experts_per_tok"] or tokens == 0:
            read = active
        else:
            e, k = r["routed_experts"], r["experts_per_tok"]
            per_expert = (resident - active) / (e - k)
            shared = max(0.0, active - k * per_expert)
            read = shared + per_expert * e * (1 - (1 - 1 / e) ** (k * tokens))
        data[p] += B[p] * read
    pa = model.get("attention_precision", "bf16")
    for n_i, c_i in zip(n, c, strict=True):
        m = c_i + math.ceil(n_i / 2)
        for layer in model["layers"]:
            if layer["kind"] == "linear":
                data[pa] += layer["count"] * layer["state_bytes"]
                continue
            window = layer.get("window", 0)
            attended = min(m, window) if window > 0 else m
            kvpp = (
                (1 if layer.get("kv_shared", False) else 2)
                * layer["kv_heads"]
                * layer["head_dim"]
                * B[layer.get("kv_precision", "bf16")]
            )
            flops[pa] += layer["count"] * 4 * layer["heads"] * layer["head_dim"] * n_i * attended
            data[pa] += layer["count"] * kvpp * attended

    def rate(p: str) -> float:
        per_gpu = profile["flops_fp16"] / 2 if p == "fp32" else profile[f"flops_{p}"]
        return float(per_gpu * tp)

    bandwidth = profile["memory_bandwidth"] * tp
    t = sum(max(flops[p] / rate(p), data[p] / bandwidth) for p in set(flops) | set(data))
    if tp > 1 and tokens > 0:
        volume = tokens * model["hidden_dim"] * model.get("activation_bytes", 2)
        num_layers = sum(layer["count"] for layer in model["layers"])
        t += 2 * num_layers * all_reduce(profile["fabric"], tp, volume)
    tc = entry.get("time_correction", {})
    return float(tc.get("alpha", 1.0) * t + tc.get("beta", 0.0))


# ---------------------------------------------------------------------------------------
# reference numbers: gpt-oss-20b on B200


@pytest.fixture(scope="module")
def gpt_oss() -> Deployment:
    return load_deployment(GPT_OSS_20B, "b200", PROFILES)


@pytest.fixture(scope="module")
def gpt_oss_roofline(gpt_oss: Deployment) -> Roofline:
    return Roofline(gpt_oss)


def test_gpt_oss_kv_capacity_reference_numbers(gpt_oss: Deployment) -> None:
    """gpt-oss-20b on b200: resident weights 13,150,126,080 B, KV 159,649,873,920 B, block
    1,572,864 B, 101,502 blocks."""
    assert gpt_oss.model.resident_weight_bytes == 13_150_126_080
    assert gpt_oss.kv_bytes == 159_649_873_920
    assert gpt_oss.block_bytes == 1_572_864
    assert gpt_oss.total_blocks == 101_502
    rf = Roofline(gpt_oss)
    assert (rf.block_bytes, rf.total_blocks) == (1_572_864, 101_502)


def test_gpt_oss_expert_split(gpt_oss_roofline: Roofline) -> None:
    """per-expert params 597,196,800 and shared 0: one token reads exactly the expected
    distinct experts × per-expert bytes of the fp4 stream, and the bf16 stream its active."""
    per_expert_bytes = 0.5 * 597_196_800
    fp4, bf16 = gpt_oss_roofline.weight_read(1)
    assert fp4 == pytest.approx(per_expert_bytes * expert_read_fraction(32, 4, 1), rel=1e-12)
    assert bf16 == 2 * 1_218_355_200


@pytest.mark.parametrize(
    ("batch", "experts", "ms"),
    [(1, 3.82, 0.4477), (8, 20.41, 1.0715), (24, 30.48, 1.4572), (256, 32.00, 1.6578)],
)
def test_gpt_oss_decode_reference_numbers(
    gpt_oss_roofline: Roofline, batch: int, experts: float, ms: float
) -> None:
    """Decode with every request at c = 100, n = 1: distinct experts and step time as in the
    published gpt-oss-20b / B200 table (to every printed digit)."""
    assert round(expert_read_fraction(32, 4, batch), 2) == experts
    fp4 = gpt_oss_roofline.weight_read(batch)[0]
    assert round(fp4 / (0.5 * 597_196_800), 2) == experts
    t = step(gpt_oss_roofline, [1] * batch, [100] * batch)
    assert round(t * 1e3, 4) == ms


@pytest.mark.parametrize(("batch", "prompt", "ms"), [(8, 100, 2.0678), (24, 300, 11.7944)])
def test_gpt_oss_prefill_reference_numbers(
    gpt_oss_roofline: Roofline, batch: int, prompt: int, ms: float
) -> None:
    """Prefill from scratch: 8 × 100 tokens → 2.0678 ms; 24 × 300 → 11.7944 ms."""
    t = step(gpt_oss_roofline, [prompt] * batch, [0] * batch)
    assert round(t * 1e3, 4) == ms


def test_gpt_oss_per_token_decode_cost_falls_with_batch(gpt_oss_roofline: Roofline) -> None:
    """Per-token decode cost falls steeply with batch size (expert reads are shared)."""
    per_token = [step(gpt_oss_roofline, [1] * b, [100] * b) / b for b in (1, 8, 24, 256)]
    assert all(a > 2 * b for a, b in zip(per_token, per_token[1:], strict=False))


def test_gpt_oss_matches_the_reference_transcription(gpt_oss: Deployment) -> None:
    """A mixed batch (prefill chunks past the 128-token window, decodes at long context) is
    priced as the loop-by-loop transcription prices it."""
    config = tomllib.loads(GPT_OSS_20B.read_text())
    profile = tomllib.loads((PROFILES / "b200.toml").read_text())
    n, c = [512, 1, 1, 77], [1000, 5, 40_000, 0]
    expected = reference_step_time(config, profile, n, c, hardware="b200")
    assert step(Roofline(gpt_oss), n, c) == pytest.approx(expected, rel=1e-9)


# ---------------------------------------------------------------------------------------
# dense closed forms (tiny-dense: 1e9 bf16 params, 4 layers × 8 heads × 64, 2 KV heads;
# kvpp = 2·2·64·2 = 512 B; 1 PFLOP/s bf16, 1 TB/s)


def test_dense_decode_is_memory_bound_closed_form(tmp_path: Path) -> None:
    """Decode of 3 requests at c = 10, 20, 30: memory-bound, t = (weights + KV) / BW with
    m = c + 1 (a decode token attends c + 1 positions)."""
    rf = Roofline(build(tmp_path, dense_config()))
    flops = 2 * 1e9 * 3 + 4 * (4 * 8 * 64) * (11 + 21 + 31)
    data = 2 * 1e9 + 4 * 512 * (11 + 21 + 31)
    assert data / 1e12 > flops / 1e15
    assert step(rf, [1, 1, 1], [10, 20, 30]) == pytest.approx(data / 1e12, rel=1e-12)


def test_dense_prefill_is_compute_bound_closed_form(tmp_path: Path) -> None:
    """Prefill chunks of 2001 (fresh) and 1000 (on 500 resident): compute-bound, with
    m = c + ceil(n / 2) = 1001 and 1000."""
    rf = Roofline(build(tmp_path, dense_config()))
    flops = 2 * 1e9 * 3001 + 4 * (4 * 8 * 64) * (2001 * 1001 + 1000 * 1000)
    data = 2 * 1e9 + 4 * 512 * (1001 + 1000)
    assert flops / 1e15 > data / 1e12
    assert step(rf, [2001, 1000], [0, 500]) == pytest.approx(flops / 1e15, rel=1e-12)


@pytest.mark.parametrize(
    ("n", "c"),
    [
        ([1], [0]),
        ([1] * 7, [0, 1, 2, 100, 1000, 4000, 8000]),
        ([4096], [0]),
        ([17, 1, 300], [3, 900, 0]),
    ],
)
def test_dense_matches_the_reference_transcription(
    tmp_path: Path, n: list[int], c: list[int]
) -> None:
    """Any batch on tiny-dense is priced as the cost model's formulas price it."""
    config = dense_config()
    rf = Roofline(build(tmp_path, config))
    assert step(rf, n, c) == pytest.approx(
        reference_step_time(config, gpu_profile(), n, c), rel=1e-12
    )


def test_precision_streams_are_summed_each_at_its_own_bound(tmp_path: Path) -> None:
    """With an fp8 stream memory-bound and a bf16 stream compute-bound in the same step,
    t = max(fp8) + max(bf16): streams are serial, each takes its own max."""
    config = dense_config(
        model={
            "weights": [
                {"precision": "fp8", "active_params": 1e9, "resident_params": 1e9},
                {"precision": "bf16", "active_params": 1e8, "resident_params": 1e8},
            ]
        }
    )
    profile = gpu_profile(flops_fp8=1.0e16)
    rf = Roofline(build(tmp_path, config, profile))
    # T = 3000 fresh tokens in one chunk: m = 1500
    fp8 = max(2 * 1e9 * 3000 / 1e16, 1e9 / 1e12)  # memory: 1 ms
    attn_flops = 4 * (4 * 8 * 64) * 3000 * 1500
    bf16 = max((2 * 1e8 * 3000 + attn_flops) / 1e15, (2 * 1e8 + 4 * 512 * 1500) / 1e12)
    assert fp8 == 1e-3 and bf16 > (2 * 1e8 + 4 * 512 * 1500) / 1e12
    assert step(rf, [3000], [0]) == pytest.approx(fp8 + bf16, rel=1e-12)


def test_attention_is_charged_to_attention_precision(tmp_path: Path) -> None:
    """Attention FLOPs and KV reads go to ``attention_precision`` (fp32 here: fp16 / 2 rate),
    not to the weights' stream."""
    config = dense_config(model={"attention_precision": "fp32"})
    rf = Roofline(build(tmp_path, config))
    n, c = [4000], [20_000]
    weights = max(2 * 1e9 * 4000 / 1e15, 2e9 / 1e12)
    attn = max(4 * (4 * 8 * 64) * 4000 * 22_000 / 0.5e15, 4 * 512 * 22_000 / 1e12)
    assert step(rf, n, c) == pytest.approx(weights + attn, rel=1e-12)
    assert step(rf, n, c) == pytest.approx(reference_step_time(config, gpu_profile(), n, c))


def test_kv_precision_and_kv_shared_set_bytes_per_position(tmp_path: Path) -> None:
    """kvpp = (kv_shared ? 1 : 2) · kv_heads · head_dim · b(kv_precision): an fp8 shared-KV
    layer reads a quarter of the bf16 K+V bytes."""
    full = Roofline(build(tmp_path, dense_config()))
    quarter = Roofline(
        build(
            tmp_path,
            dense_config(model={"layers": [attention(kv_precision="fp8", kv_shared=True)]}),
        )
    )
    kv = 4 * 512 * 1001
    assert step(full, [1], [1000]) == pytest.approx((2e9 + kv) / 1e12, rel=1e-12)
    assert step(quarter, [1], [1000]) == pytest.approx((2e9 + kv / 4) / 1e12, rel=1e-12)
    assert quarter.block_bytes == full.block_bytes / 4 == 4 * 512 * 16 / 4


def test_stream_without_routing_reads_active_not_resident(tmp_path: Path) -> None:
    """A dense stream with resident 3e9 > active 1e9 (e.g. an embedding) reads 1e9 values;
    so does a routed stream with E <= k."""
    for routing in (None, {"routed_experts": 4, "experts_per_tok": 4, "moe_layers": 4}):
        weights = {"precision": "bf16", "active_params": 1e9, "resident_params": 3e9}
        if routing is not None:
            weights["routing"] = routing
        rf = Roofline(build(tmp_path, dense_config(model={"weights": [weights]})))
        assert rf.weight_read(1) == [2e9]
        assert rf.weight_read(5000) == [2e9]
        assert step(rf, [1], [0]) == pytest.approx((2e9 + 4 * 512 * 1) / 1e12, rel=1e-12)


def test_a_skewed_router_touches_the_zipf_expectation_of_experts(tmp_path: Path) -> None:
    """Rule 8, by hand: the stream of the test below (E = 8, k = 2, per_expert 1e9, shared
    2e9) with ``expert_skew = 1``: expert i is picked with p_i = (1/i) / H_8 by each of a
    token's two picks, so one token touches sum_i 1 - (1 - p_i)^2 = 2 - sum_i p_i^2
    experts; many tokens still touch them all. ``expert_skew = 0`` is the uniform price
    to the bit."""
    weights = {
        "precision": "bf16",
        "active_params": 4e9,
        "resident_params": 10e9,
        "routing": {"routed_experts": 8, "experts_per_tok": 2, "moe_layers": 4},
    }
    skewed = dense_config(
        model={"weights": [weights]}, hardware={"gpu": {"efficiency": {"expert_skew": 1.0}}}
    )
    rf = Roofline(build(tmp_path, skewed))
    harmonic = sum(1 / i for i in range(1, 9))
    touched = 2 - sum((1 / i / harmonic) ** 2 for i in range(1, 9))
    assert touched == pytest.approx(1.7932, abs=1e-4)  # against uniform 8 (1 - (7/8)^2) = 1.875
    assert rf.weight_read(1)[0] == pytest.approx(2 * (2e9 + touched * 1e9), rel=1e-12)
    assert rf.weight_read(100_000)[0] == pytest.approx(2 * 10e9)
    assert expert_read_fraction(8, 2, 1, 1.0) == pytest.approx(touched, rel=1e-12)
    plain = dense_config(model={"weights": [weights]})
    zero = dense_config(
        model={"weights": [weights]}, hardware={"gpu": {"efficiency": {"expert_skew": 0.0}}}
    )
    uniform, at_zero = Roofline(build(tmp_path, plain)), Roofline(build(tmp_path, zero))
    for tokens in (1, 3, 77, 4096):
        assert at_zero.weight_read(tokens) == uniform.weight_read(tokens)
        assert expert_read_fraction(8, 2, tokens, 0.0) == expert_read_fraction(8, 2, tokens)
    for n, c in (([1, 1], [5, 60]), ([700, 1], [0, 3000])):
        assert step(at_zero, n, c) == step(uniform, n, c)
    assert step(rf, [1, 1], [5, 60]) < step(uniform, [1, 1], [5, 60])  # fewer experts read
    bad = dense_config(hardware={"gpu": {"efficiency": {"expert_skew": -1}}})
    with pytest.raises(ConfigError, match="expert_skew"):
        build(tmp_path, bad)


def test_a_layer_overhead_is_paid_once_per_layer_in_every_step(tmp_path: Path) -> None:
    """Rule 9, by hand: the 4-layer model of these tests with ``step_overhead`` 1 ms and
    ``layer_overhead`` 50 µs: one sequence decoding at 1,000 positions costs its roofline,
    (2e9 + 4 · 512 · 1001) / 1e12 s, plus 1 ms + 4 × 50 µs; a model of two layer classes
    (2 + 3 layers) pays it five times; at 0 every price is the plain one, to the bit; a
    value out of its range is a one-line error naming the key."""
    eff = {"step_overhead": 1e-3, "layer_overhead": 5e-5}
    rf = Roofline(build(tmp_path, dense_config(hardware={"gpu": {"efficiency": eff}})))
    roof = (2e9 + 4 * 512 * 1001) / 1e12
    assert step(rf, [1], [1000]) == pytest.approx(roof + 1e-3 + 4 * 5e-5, rel=1e-12)
    two = dense_config(
        model={"layers": [attention(count=2), attention(count=3, window=128)]},
        hardware={"gpu": {"efficiency": {"layer_overhead": 5e-5}}},
    )
    plain_two = dense_config(model={"layers": [attention(count=2), attention(count=3, window=128)]})
    n, c = [1], [1000]
    paid = step(Roofline(build(tmp_path, two)), n, c) - step(
        Roofline(build(tmp_path, plain_two)), n, c
    )
    assert paid == pytest.approx(5 * 5e-5, rel=1e-9)
    zero = dense_config(hardware={"gpu": {"efficiency": {"layer_overhead": 0.0}}})
    at_zero, plain = Roofline(build(tmp_path, zero)), Roofline(build(tmp_path, dense_config()))
    for n, c in (([1, 1], [5, 60]), ([700, 1], [0, 3000])):
        assert step(at_zero, n, c) == step(plain, n, c)
    for value in (-1e-6, 0.5):
        bad = dense_config(hardware={"gpu": {"efficiency": {"layer_overhead": value}}})
        with pytest.raises(ConfigError, match="layer_overhead"):
            build(tmp_path, bad)


def test_routed_stream_reads_shared_plus_expected_distinct_experts(tmp_path: Path) -> None:
    """active 4e9, resident 10e9, E = 8, k = 2: per_expert = 1e9, shared = 2e9; one token
    reads 2e9 + 8·(1 − (7/8)²)·1e9 values, and many tokens read (almost) all resident."""
    weights = {
        "precision": "bf16",
        "active_params": 4e9,
        "resident_params": 10e9,
        "routing": {"routed_experts": 8, "experts_per_tok": 2, "moe_layers": 4},
    }
    config = dense_config(model={"weights": [weights]})
    rf = Roofline(build(tmp_path, config))
    assert rf.weight_read(1)[0] == pytest.approx(2 * (2e9 + 8 * (1 - (7 / 8) ** 2) * 1e9))
    assert rf.weight_read(3)[0] == pytest.approx(2 * (2e9 + 8 * (1 - (7 / 8) ** 6) * 1e9))
    assert rf.weight_read(10_000)[0] == pytest.approx(2 * 10e9)
    for n, c in (([1, 1], [5, 60]), ([700, 1], [0, 3000])):
        expected = reference_step_time(config, gpu_profile(), n, c)
        assert step(rf, n, c) == pytest.approx(expected, rel=1e-12)


def test_empty_batch_reads_active_weights_only(tmp_path: Path, gpt_oss: Deployment) -> None:
    """T = 0: no FLOPs, no KV, no collectives; every stream reads its active weights."""
    rf = Roofline(gpt_oss)
    assert rf.weight_read(0) == [0.5 * 2_388_787_200, 2 * 1_218_355_200]
    expected = (0.5 * 2_388_787_200 + 2 * 1_218_355_200) / 8.0e12
    assert step(rf, [], []) == pytest.approx(expected, rel=1e-12)
    tp4 = Roofline(build(tmp_path, dense_config(hardware={"gpu": {"tp": 4}})))
    assert tp4.collective_time(0) == 0.0
    assert step(tp4, [], []) == pytest.approx(2e9 / 4e12, rel=1e-12)


# ---------------------------------------------------------------------------------------
# time correction


def test_time_correction_applies_alpha_then_beta(tmp_path: Path) -> None:
    """With alpha = 1.5, beta = 2 ms every step costs 1.5 · roofline + 0.002 s, and the
    uncorrected roofline is reported alongside."""
    plain = Roofline(build(tmp_path, dense_config()))
    tc = {"hardware": {"gpu": {"time_correction": {"alpha": 1.5, "beta": 0.002}}}}
    corrected = Roofline(build(tmp_path, merge(dense_config(), tc)))
    for n, c in (([1, 1, 1], [10, 20, 30]), ([2001, 1000], [0, 500]), ([], [])):
        roof = step(plain, n, c)
        cost = corrected.step_cost(ints(n), ints(c))
        assert cost.roofline == pytest.approx(roof, rel=1e-12)
        assert cost.seconds == pytest.approx(1.5 * roof + 0.002, rel=1e-12)
        assert corrected.step_time(ints(n), ints(c)) == cost.seconds


# ---------------------------------------------------------------------------------------
# collectives (tp > 1)


def collective_case(
    tmp_path: Path, tp: int, up_inr: bool, out_inr: bool
) -> tuple[Roofline, dict[str, Any], dict[str, Any]]:
    config = dense_config(hardware={"gpu": {"tp": tp}})
    profile = gpu_profile(
        fabric={
            "scale_up": {"in_network_reduction": up_inr},
            "scale_out": {"in_network_reduction": out_inr},
        }
    )
    return Roofline(build(tmp_path, config, profile)), config, profile


def tp_roofline(tp: int, n: Sequence[int], c: Sequence[int]) -> float:
    """tiny-dense without collectives on tp GPUs: R = 1e15·tp, BW = 1e12·tp."""
    m = [ci + math.ceil(ni / 2) for ni, ci in zip(n, c, strict=True)]
    flops = 2 * 1e9 * sum(n) + 4 * (4 * 8 * 64) * sum(ni * mi for ni, mi in zip(n, m, strict=True))
    data = 2e9 + 4 * 512 * sum(m)
    return max(flops / (1e15 * tp), data / (1e12 * tp))


@pytest.mark.parametrize("tokens", [1, 3001])
@pytest.mark.parametrize(
    ("tp", "f"),
    [(2, 2 * 1 / 2), (4, 2 * 3 / 4)],
)
def test_in_node_all_reduce_without_in_network_reduction(
    tmp_path: Path, tp: int, f: float, tokens: int
) -> None:
    """tp ≤ gpus_per_node, no in-network reduction: 2 · num_layers · (lat_up +
    2(g−1)/g · V / bw_up) with V = T · hidden · activation_bytes."""
    rf, config, profile = collective_case(tmp_path, tp, up_inr=False, out_inr=False)
    n, c = [tokens], [0]
    volume = tokens * 1024 * 2
    coll = 2 * 4 * (1e-5 + f * volume / 1e11)
    assert rf.collective_time(tokens) == pytest.approx(coll, rel=1e-12)
    assert step(rf, n, c) == pytest.approx(tp_roofline(tp, n, c) + coll, rel=1e-12)
    assert step(rf, n, c) == pytest.approx(reference_step_time(config, profile, n, c), rel=1e-12)


@pytest.mark.parametrize("tokens", [1, 3001])
def test_in_node_all_reduce_with_in_network_reduction(tmp_path: Path, tokens: int) -> None:
    """With in-network reduction the in-node all-reduce moves V once (f = 1, not 2(g−1)/g)."""
    rf, config, profile = collective_case(tmp_path, 4, up_inr=True, out_inr=False)
    n, c = [tokens], [0]
    coll = 2 * 4 * (1e-5 + 1.0 * tokens * 1024 * 2 / 1e11)
    assert rf.collective_time(tokens) == pytest.approx(coll, rel=1e-12)
    assert step(rf, n, c) == pytest.approx(tp_roofline(4, n, c) + coll, rel=1e-12)
    assert step(rf, n, c) == pytest.approx(reference_step_time(config, profile, n, c), rel=1e-12)


@pytest.mark.parametrize("tokens", [1, 3001])
@pytest.mark.parametrize(
    ("tp", "up_inr", "out_inr", "f_out"),
    [
        (8, False, False, 2 * 1 / 2),
        (8, True, False, 2 * 1 / 2),
        (16, False, False, 2 * 3 / 4),
        (16, False, True, 1.0),
        (12, True, False, 2 * 2 / 3),
    ],
)
def test_cross_node_all_reduce(
    tmp_path: Path, tp: int, up_inr: bool, out_inr: bool, f_out: float, tokens: int
) -> None:
    """tp > gpus_per_node (k = 4) over n = ceil(tp / k) nodes: 2·(lat_up + (k−1)/k · V / bw_up)
    + lat_out + f_out · (V / k) / bw_out per all-reduce, two per layer."""
    rf, config, profile = collective_case(tmp_path, tp, up_inr, out_inr)
    n, c = [tokens], [0]
    volume = tokens * 1024 * 2
    ar = 2 * (1e-5 + 3 / 4 * volume / 1e11) + 1e-4 + f_out * (volume / 4) / 1e10
    assert rf.collective_time(tokens) == pytest.approx(2 * 4 * ar, rel=1e-12)
    expected = tp_roofline(tp, n, c) + 2 * 4 * ar
    assert step(rf, n, c) == pytest.approx(expected, rel=1e-12)
    assert step(rf, n, c) == pytest.approx(reference_step_time(config, profile, n, c), rel=1e-12)


def test_collective_message_uses_activation_bytes_and_every_layer(tmp_path: Path) -> None:
    """V scales with activation_bytes, and num_layers counts every class (windowed and
    linear too)."""
    layers = [
        attention(count=2),
        attention(count=3, window=64),
        {"kind": "linear", "count": 5, "state_bytes": 8},
    ]
    config = dense_config(
        model={"activation_bytes": 4, "layers": layers}, hardware={"gpu": {"tp": 2}}
    )
    rf = Roofline(build(tmp_path, config))
    assert rf.collective_time(100) == pytest.approx(2 * 10 * (1e-5 + 1.0 * 100 * 1024 * 4 / 1e11))


def test_tp_one_has_no_collectives(tmp_path: Path) -> None:
    """tp = 1 adds no collective time."""
    rf = Roofline(build(tmp_path, dense_config()))
    assert rf.collective_time(3001) == 0.0


# ---------------------------------------------------------------------------------------
# windowed attention, linear layers, blocks_for

MIXED_LAYERS = [
    attention(count=2),
    attention(count=3, window=128),
    {"kind": "linear", "count": 2, "state_bytes": 10_000},
]


@pytest.mark.parametrize(
    ("n", "c"),
    [([1], [50]), ([1], [5000]), ([1, 1, 1], [0, 127, 128]), ([400], [0]), ([300, 1], [2000, 90])],
)
def test_window_and_linear_layers_match_the_reference_transcription(
    tmp_path: Path, n: list[int], c: list[int]
) -> None:
    """A windowed layer attends min(t, window); a linear layer reads its state once per
    request and does no attention; priced as the cost model says."""
    config = dense_config(model={"layers": MIXED_LAYERS})
    rf = Roofline(build(tmp_path, config))
    expected = reference_step_time(config, gpu_profile(), n, c)
    assert step(rf, n, c) == pytest.approx(expected, rel=1e-12)


def test_windowed_kv_bytes_stop_growing_past_the_window(tmp_path: Path) -> None:
    """For a memory-bound decode, adding a 3-layer window-128 class costs 3·512·min(m, 128)
    bytes: the same at c = 1000 as at c = 50,000, while the full class keeps growing."""
    full_only = Roofline(build(tmp_path, dense_config(model={"layers": [attention(count=2)]})))
    windowed = Roofline(
        build(
            tmp_path,
            dense_config(model={"layers": [attention(count=2), attention(count=3, window=128)]}),
        )
    )
    extra = [step(windowed, [1], [c]) - step(full_only, [1], [c]) for c in (50, 1000, 50_000)]
    assert extra[0] == pytest.approx(3 * 512 * 51 / 1e12, rel=1e-6)
    assert extra[1] == pytest.approx(3 * 512 * 128 / 1e12, rel=1e-6)
    assert extra[2] == pytest.approx(extra[1], rel=1e-6)
    growth = step(full_only, [1], [50_000]) - step(full_only, [1], [1000])
    assert growth == pytest.approx(2 * 512 * 49_000 / 1e12, rel=1e-6)


def test_windowed_attention_flops_use_min_of_context_and_window(tmp_path: Path) -> None:
    """A compute-bound chunk of 4000 on 10,000 resident: the full class attends m = 12,000
    positions, the windowed class 128."""
    rf = Roofline(
        build(
            tmp_path,
            dense_config(model={"layers": [attention(count=2), attention(count=3, window=128)]}),
        )
    )
    per_layer = 4 * 8 * 64 * 4000
    flops = 2 * 1e9 * 4000 + 2 * per_layer * 12_000 + 3 * per_layer * 128
    data = 2e9 + 2 * 512 * 12_000 + 3 * 512 * 128
    assert flops / 1e15 > data / 1e12
    assert step(rf, [4000], [10_000]) == pytest.approx(flops / 1e15, rel=1e-12)


def test_block_bytes_count_only_full_context_classes(tmp_path: Path) -> None:
    """block_bytes = Σ over full-context classes count · kvpp · block_size (windowed and
    linear classes excluded)."""
    dep = build(tmp_path, dense_config(model={"layers": MIXED_LAYERS}))
    assert dep.block_bytes == 2 * 512 * 16 == Roofline(dep).block_bytes
    assert dep.total_blocks == math.floor((90e9 - 2e9) / (2 * 512 * 16))


@pytest.mark.parametrize("t", [0, 1, 15, 16, 17, 127, 128, 129, 1000, 100_000])
def test_blocks_for_counts_content_and_private_blocks(tmp_path: Path, t: int) -> None:
    """blocks_for(t) = ceil(t / 16) + ceil((2·10,000 + 3·512·min(t, 128)) / 16,384): linear
    state and windowed KV live in private blocks."""
    rf = Roofline(build(tmp_path, dense_config(model={"layers": MIXED_LAYERS})))
    private = 2 * 10_000 + 3 * 512 * min(t, 128)
    assert rf.blocks_for(t) == math.ceil(t / 16) + math.ceil(private / 16_384)


def test_blocks_for_examples(tmp_path: Path) -> None:
    """Hand-worked: t = 1 → 1 + 2 = 3 blocks; t = 1000 → 63 + 14 = 77 blocks; a model with
    only full-context attention needs just ceil(t / block_size)."""
    mixed = Roofline(build(tmp_path, dense_config(model={"layers": MIXED_LAYERS})))
    assert (mixed.blocks_for(1), mixed.blocks_for(1000)) == (3, 77)
    dense = Roofline(build(tmp_path, dense_config()))
    assert [dense.blocks_for(t) for t in (1, 16, 17, 1000)] == [1, 1, 2, 63]


@pytest.mark.parametrize("layers", ["mixed", "dense", "linear only"])
def test_room_for_is_the_most_positions_the_blocks_hold(tmp_path: Path, layers: str) -> None:
    """room_for(b) is the largest p with blocks_for(p) <= b (0 when none fits), for every
    b up to a 3000-position request: the engine skips a running request's block lookup
    while its positions stay within it."""
    model = {
        "mixed": {"layers": MIXED_LAYERS},
        "dense": {},
        "linear only": {"layers": [attention(count=2), MIXED_LAYERS[2]]},
    }[layers]
    rf = Roofline(build(tmp_path, dense_config(model=model)))
    sizes = [rf.blocks_for(p) for p in range(3001)]
    for b in range(sizes[-1]):  # blocks whose room ends before position 3000
        fits = [p for p, size in enumerate(sizes) if size <= b]
        assert rf.room_for(b) == (fits[-1] if fits else 0), b


def test_gpt_oss_blocks_for_saturates_past_the_window(gpt_oss_roofline: Roofline) -> None:
    """gpt-oss-20b (block 64): the 12 window-128 layers add ceil(12·2048·min(t,128) /
    1,572,864) private blocks: 1 up to t = 64, 2 from t = 65 on."""
    rf = gpt_oss_roofline
    assert rf.blocks_for(1) == 1 + 1
    assert rf.blocks_for(64) == 1 + 1
    assert rf.blocks_for(65) == 2 + 2
    assert rf.blocks_for(128) == 2 + 2
    assert rf.blocks_for(100_000) == math.ceil(100_000 / 64) + 2


@pytest.mark.parametrize("config", sorted(p.name for p in Path("configs").glob("*.toml")))
@pytest.mark.parametrize("hardware", ["b200", "h200"])
def test_batch_terms_price_a_list_batch_exactly_as_step_cost(config: str, hardware: str) -> None:
    """The engine's list form gives the very same StepCost (==, not approximately) as the
    array form, for batches below, at and above SMALL_BATCH, decodes and prefill chunks
    mixed, on every shipped model; asking again for a token count already seen too."""
    rf = Roofline(load_deployment(Path("configs") / config, hardware, PROFILES))
    rng = np.random.default_rng(7)
    for size in (0, 1, 2, 5, SMALL_BATCH - 1, SMALL_BATCH, SMALL_BATCH + 1, 100, 300):
        for _ in range(3):
            ns = [int(x) for x in rng.choice([1, 1, 1, 16, 512], size)]
            cs = [int(x) for x in rng.integers(0, 20_000, size)]
            arrays = rf.step_cost(np.array(ns, dtype=np.int64), np.array(cs, dtype=np.int64))
            listed = rf.price(rf.batch_terms(ns, cs))
            assert listed == arrays == rf.price(rf.batch_terms(ns, cs))


@pytest.mark.parametrize("config", sorted(p.name for p in Path("configs").glob("*.toml")))
def test_a_sequence_added_to_a_batchs_terms_prices_it_as_the_batch_with_it(config: str) -> None:
    """``add_sequence`` (a late arrival joining the step in flight) gives exactly the terms
    and the price of the whole batch with the sequence, on every shipped model, from an
    empty batch, across SMALL_BATCH, prefill chunks and decodes, past the windows."""
    rf = Roofline(load_deployment(Path("configs") / config, "b200", PROFILES))
    rng = np.random.default_rng(11)
    for size in (0, 1, SMALL_BATCH - 1, SMALL_BATCH, 100):
        ns = [int(x) for x in rng.choice([1, 1, 16, 512], size)]
        cs = [int(x) for x in rng.integers(0, 20_000, size)]
        terms = rf.batch_terms(ns, cs)
        for n, c in ((51, 0), (1, 5), (1, 200_000), (700, 300)):
            rf.add_sequence(terms, n, c)
            ns.append(n)
            cs.append(c)
            assert terms == rf.batch_terms(ns, cs)
            assert rf.price(terms) == rf.price(rf.batch_terms(ns, cs))
