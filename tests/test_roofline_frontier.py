"""The step-cost model's newer terms, against hand arithmetic: MLA layers (latent KV bytes,
absorbed decode and expanded prefill FLOPs), expert-parallel all-to-alls in and across
nodes, data-parallel attention (weights, KV per rank, the lockstep price) and a
speculative verify step with each kind of drafter.

Every expected number below is worked out in the comments next to it from the round
figures of ``tests/configs_util.gpu_profile`` (1e15 bf16 FLOP/s, 1e12 B/s, 4 GPUs a node
over 1e11 B/s links of 10 us, 1e10 B/s between nodes at 100 us).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from inference_lab.core.config import Deployment, load_model_config
from inference_lab.core.roofline import Roofline, all_to_all_time
from tests.configs_util import attention, config_error, dense_config, merge, moe_config, write_setup


def approx(value: float) -> Any:
    return pytest.approx(value, rel=1e-12, abs=0.0)


def build(tmp_path: Path, config: dict[str, Any], entry: str = "gpu") -> Deployment:
    sub = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
    sub.mkdir()
    path, profiles = write_setup(sub, config)
    return load_model_config(path, profiles).deployments[entry]


def mla(count: int = 2, **changes: Any) -> dict[str, Any]:
    """An MLA class: 16 heads, latent 512 + rope 64 (576 values = 1,152 B a position in
    bf16), nope 128, v 128."""
    return merge(
        {
            "kind": "mla",
            "count": count,
            "heads": 16,
            "kv_latent_dim": 512,
            "rope_dim": 64,
            "qk_nope_dim": 128,
            "v_head_dim": 128,
        },
        changes,
    )


# ---------------------------------------------------------------------------------------
# MLA


def test_mla_kv_bytes_are_the_latents(tmp_path: Path) -> None:
    """A position of an MLA layer holds its latent and rope key: (512 + 64) x 2 B = 1,152 B
    per layer, whatever the head count; a 16-token block of 2 layers is 36,864 B."""
    dep = build(tmp_path, dense_config(model={"layers": [mla()]}))
    assert dep.model.layers[0].kv_bytes_per_position == 1152
    assert dep.block_bytes == 2 * 1152 * 16 == 36_864


def test_mla_decode_is_absorbed_and_reads_the_latent(tmp_path: Path) -> None:
    """64 sequences decoding at c = 999 (each attends m = 1,000 positions): absorbed form,
    2 N (2 Lkv + R) = 2 * 16 * 1,088 = 34,816 FLOPs a (query, key) pair and layer, 69,632
    for both layers: 69,632 * 64,000 = 4,456,448,000 on top of the weights' 2 * 1e9 * 64 =
    1.28e11 -> 1.32456448e-4 s of compute. Bytes: 2e9 of weights + 2 * 1,152 * 64,000 =
    147,456,000 of latents -> 2.147456e-3 s, the step's time (memory-bound)."""
    rf = Roofline(build(tmp_path, dense_config(model={"layers": [mla()]})))
    cost = rf.price(rf.batch_terms([1] * 64, [999] * 64))
    assert cost.compute == approx((1.28e11 + 4_456_448_000) / 1e15)
    assert cost.memory == approx((2e9 + 147_456_000) / 1e12)
    assert cost.seconds == approx(2.147456e-3)


def test_mla_prefill_is_expanded_with_its_context_up_projected(tmp_path: Path) -> None:
    """A 1,000-token chunk on top of c = 3,000 (m = 3,500): expanded form, 2 N (P + R + V) =
    2 * 16 * 320 = 10,240 FLOPs a pair and layer, 20,480 for both: 20,480 * 3.5e6 =
    7.168e10; the cached context up-projected, 2 Lkv N (P + V) = 4,194,304 a position and
    layer, 8,388,608 * 3,000 = 2.5165824e10; weights 2 * 1e9 * 1,000 = 2e12. Compute
    2.096845824e12 / 1e15 = 2.096845824e-3 s beats memory (2e9 + 2 * 1,152 * 3,500 =
    2,008,064,000 B -> 2.008064e-3 s)."""
    rf = Roofline(build(tmp_path, dense_config(model={"layers": [mla()]})))
    cost = rf.price(rf.batch_terms([1000], [3000]))
    assert cost.compute == approx(2.096845824e-3)
    assert cost.seconds == approx(2.096845824e-3)


def test_mla_sums_decode_and_prefill_apart_in_one_batch(tmp_path: Path) -> None:
    """A decode at c = 999 and the chunk above in one batch: each priced in its own form
    (69,632 * 1,000 + 20,480 * 3.5e6 + 8,388,608 * 3,000 FLOPs of attention), the same
    sums whether the batch is summed in Python integers or with numpy."""
    rf = Roofline(build(tmp_path, dense_config(model={"layers": [mla()]})))
    terms = rf.batch_terms([1, 1000], [999, 3000])
    assert terms.mla == [[1000 + 3_500_000, 1000 + 3500, 3_500_000, 3000]]
    attention_flops = 69_632 * 1000 + 20_480 * 3.5e6 + 8_388_608 * 3000
    cost = rf.price(terms)
    assert cost.compute == approx((2e9 * 1001 + attention_flops) / 1e15)
    big = rf.batch_terms([1] * 40 + [1000], [999] * 40 + [3000])  # numpy path (> 32)
    small_sum = [40 * 1000 + 3_500_000, 40 * 1000 + 3500, 3_500_000, 3000]
    assert big.mla == [small_sum]


def test_mla_latent_is_replicated_on_every_gpu_of_the_attention_group(tmp_path: Path) -> None:
    """Tensor parallelism splits heads, not the latent: with tp 2 each GPU keeps every
    position's 1,152 B, so a replica spends 2,304 B per position and layer (a block of 2
    layers: 73,728 B), and a decode reads that much."""
    dep = build(tmp_path, dense_config(model={"layers": [mla()]}, hardware={"gpu": {"tp": 2}}))
    assert dep.block_bytes == 2 * 2304 * 16
    rf = Roofline(dep)
    cost = rf.price(rf.batch_terms([1], [999]))
    assert cost.memory == approx((2e9 + 2 * 2304 * 1000) / 2e12)


def test_an_attention_only_model_is_priced_as_before_with_mla_terms_empty(tmp_path: Path) -> None:
    """Without MLA classes the batch terms carry no MLA sums: the prices are Rule 1's."""
    rf = Roofline(build(tmp_path, dense_config()))
    terms = rf.batch_terms([1, 7], [10, 20])
    assert terms.mla == []


def test_mla_layer_keys_are_validated(tmp_path: Path) -> None:
    """An MLA class needs its latent, nope and v dims; a zero latent names the key."""
    path, profiles = write_setup(tmp_path, dense_config(model={"layers": [mla(kv_latent_dim=0)]}))
    message = config_error(load_model_config, path, profiles)
    assert message.startswith(f"{path}: model.layers[0].kv_latent_dim: must be >= 1"), message


# ---------------------------------------------------------------------------------------
# expert parallelism


def test_ep_all_to_all_within_a_node_by_hand(tmp_path: Path) -> None:
    """tp 4, ep 4 on one node: 100 tokens, 25 per GPU, each reaching another GPU with
    probability q = 1 - (3/4)^2 = 0.4375: 25 * 0.4375 * 1,024 * 2 = 22,400 B per peer, 3
    peers: 1e-5 + 67,200 / 1e11 = 1.0672e-5 s per all-to-all; 8 of them (dispatch and
    combine in 4 MoE layers) = 8.5376e-5 s. The all-reduces left are the attention
    layers' (4; no dense MLP layer): 4 * (1e-5 + 1.5 * 204,800 / 1e11) = 5.2288e-5 s."""
    dep = build(tmp_path, moe_config(tp=4, ep=4))
    assert all_to_all_time(dep, 100, 2) == approx(1.0672e-5)
    assert Roofline(dep).collective_time(100) == approx(8.5376e-5 + 5.2288e-5)


def test_ep_all_to_all_across_nodes_waits_for_the_nic(tmp_path: Path) -> None:
    """tp 8, ep 8 over two 4-GPU nodes: 800 tokens, 100 per GPU, q = 1 - (7/8)^2 =
    0.234375: 100 * 0.234375 * 2,048 = 48,000 B per peer. NVLink to 3 peers: 1e-5 +
    144,000 / 1e11 = 1.144e-5 s; the NIC to 4: 1e-4 + 192,000 / 1e10 = 1.192e-4 s, the
    slower, so one all-to-all takes 1.192e-4 s."""
    dep = build(tmp_path, moe_config(tp=8, ep=8))
    assert all_to_all_time(dep, 800, 2) == approx(1.192e-4)


def test_ep_one_keeps_the_two_all_reduces_per_layer(tmp_path: Path) -> None:
    """Without expert parallelism an MoE model's collectives are Rule 1's: 2 all-reduces
    per layer, no all-to-all."""
    dep = build(tmp_path, moe_config(tp=4))
    assert all_to_all_time(dep, 100, 2) == 0.0
    assert Roofline(dep).collective_time(100) == approx(8 * (1e-5 + 1.5 * 204_800 / 1e11))


# ---------------------------------------------------------------------------------------
# data-parallel attention


def test_dp_attention_replicates_the_dense_part_and_splits_the_kv(tmp_path: Path) -> None:
    """tp 4, ep 4, dp_attention 4: 4 ranks of 1 GPU. The stream's experts (8 * 5e8 = 4e9
    parameters) are held once, its dense part (0 here) once per rank: 8e9 B. Pool floor(100e9
    * 4 * 0.9) = 360e9 B, so each rank's KV cache is (360e9 - 8e9) / 4 = 88e9 B; blocks of 4
    layers * 512 B * 16 = 32,768 B: 2,685,546 per rank; 4 workers."""
    dep = build(tmp_path, moe_config(tp=4, ep=4, dp_attention=4))
    assert dep.resident_weight_bytes == 8_000_000_000
    assert dep.kv_bytes == 88e9
    assert dep.total_blocks == 2_685_546
    assert dep.workers == 4


def test_dp_attention_counts_a_dense_stream_once_per_rank(tmp_path: Path) -> None:
    """A second, dense stream of 1e8 bf16 parameters is held by each of the 2 ranks: 2 *
    2e8 B on top of the experts' 8e9."""
    config = moe_config(tp=2, ep=2, dp_attention=2)
    config["model"]["weights"].append(
        {"precision": "bf16", "active_params": 100_000_000, "resident_params": 100_000_000}
    )
    dep = build(tmp_path, config)
    assert dep.resident_weight_bytes == 8_000_000_000 + 2 * 200_000_000


def test_dp_attention_lockstep_price_by_hand(tmp_path: Path) -> None:
    """Two ranks of 2 GPUs each (tp 4, ep 4, dp_attention 2). Rank A decodes 10 sequences at
    c = 99 (m = 100), rank B 30. Each rank's own part reads its KV only (the stream's dense
    part is 0): A 10 * 100 * 2,048 = 2,048,000 B, B 6,144,000 B, over its 2 GPUs' 2e12
    B/s, plus its attention all-reduces over 2 GPUs (4 calls, f = 1): B 4 * (1e-5 + 61,440
    / 1e11). The experts' part, over all 4 GPUs (4e12 B/s), reads the experts the 40
    tokens touch, 1e9 B each times 8 * (1 - (7/8)^80) expected, and adds 8 all-to-alls of
    40 tokens (10 per GPU, q = 0.4375). The step is rank B's part plus the experts'."""
    dep = build(tmp_path, moe_config(tp=4, ep=4, dp_attention=2))
    rf = Roofline(dep)
    a = rf.batch_terms([1] * 10, [99] * 10)
    b = rf.batch_terms([1] * 30, [99] * 30)
    rank_b = 6_144_000 / 2e12 + 4 * (1e-5 + 30 * 2048 / 1e11)
    experts_bytes = 2 * 5e8 * 8 * (1 - (7 / 8) ** 80)
    q = 1 - (3 / 4) ** 2
    a2a = 8 * (1e-5 + 3 * (40 / 4 * q * 2048) / 1e11)
    expected = rank_b + experts_bytes / 4e12 + a2a
    assert rf.group_price([a, b]).seconds == approx(expected)
    # the same batches swapped between the ranks cost the same; rank A alone is cheaper
    assert rf.group_price([b, a]).seconds == approx(expected)
    assert rf.group_price([a, rf.batch_terms([], [])]).seconds < expected


def test_dp_attention_needs_expert_parallelism(tmp_path: Path) -> None:
    path, profiles = write_setup(tmp_path, moe_config(tp=4, dp_attention=2))
    message = config_error(load_model_config, path, profiles)
    assert message.startswith(f"{path}: hardware.gpu.dp_attention:"), message
    assert "ep > 1" in message


def test_dp_attention_must_divide_tp(tmp_path: Path) -> None:
    path, profiles = write_setup(tmp_path, moe_config(tp=4, ep=4, dp_attention=3))
    message = config_error(load_model_config, path, profiles)
    assert message.startswith(f"{path}: hardware.gpu.dp_attention: must divide tp"), message


# ---------------------------------------------------------------------------------------
# a speculative verify step


def spec_config(drafter: dict[str, Any], **speculative: Any) -> dict[str, Any]:
    config = dense_config()
    config["speculative"] = {
        "num_speculative_tokens": 3,
        "acceptance_rate": 0.7,
        "drafter": drafter,
        **speculative,
    }
    return config


def test_verify_step_with_a_fraction_drafter_by_hand(tmp_path: Path) -> None:
    """Two sequences verifying 3 drafts at c = 100: 8 positions, each attending m = 102:
    bytes 2e9 + 2 * 102 * 4 layers * 512 = 2,000,417,792 -> 2.000417792e-3 s. Without
    drafts (one position each, m = 101): 2,000,413,696 B -> 2.000413696e-3 s; the
    drafter costs 0.1 of that per draft token: 3 * 0.1 * 2.000413696e-3 =
    6.001241088e-4 s. The step: 2.6005419008e-3 s."""
    dep = build(tmp_path, spec_config({"kind": "fraction", "fraction": 0.1}))
    rf = Roofline(dep)
    verify = rf.price(rf.batch_terms([4, 4], [100, 100]))
    plain = rf.price(rf.batch_terms([1, 1], [100, 100]))
    assert verify.seconds == approx(2.000417792e-3)
    assert plain.seconds == approx(2.000413696e-3)
    draft = rf.draft_time(plain.roofline, [1, 1], [100, 100], [100, 100], 3)
    assert draft == approx(6.001241088e-4)
    assert rf.with_draft(verify, draft).seconds == approx(2.6005419008e-3)


def test_verify_step_with_a_draft_model_by_hand(tmp_path: Path) -> None:
    """A draft model of 1e8 bf16 parameters and one attention layer (512 B a position):
    its first pass runs over the batch without drafts (2 positions at m = 101: 2e8 + 2 *
    101 * 512 = 200,103,424 B -> 2.00103424e-4 s), the other 2 passes over one position
    per drafting sequence (m = 102: 200,104,448 B each -> 4.00208896e-4 s): 6.0031232e-4
    s. Its weights add to the resident ones and its layer to every block: (4 + 1) * 512 *
    16 = 40,960 B."""
    drafter = {
        "kind": "model",
        "weights": [{"precision": "bf16", "active_params": 1e8, "resident_params": 1e8}],
        "layers": [attention(1)],
    }
    dep = build(tmp_path, spec_config(drafter))
    assert dep.resident_weight_bytes == 2_200_000_000
    assert dep.block_bytes == 40_960
    rf = Roofline(dep)
    plain = rf.price(rf.batch_terms([1, 1], [100, 100]))
    draft = rf.draft_time(plain.roofline, [1, 1], [100, 100], [100, 100], 3)
    assert draft == approx(6.0031232e-4)
    verify = rf.price(rf.batch_terms([4, 4], [100, 100]))
    assert rf.with_draft(verify, draft).seconds == approx(2.000417792e-3 + 6.0031232e-4)


def test_a_drafter_sharing_the_lm_head_reads_it_without_holding_it(tmp_path: Path) -> None:
    """A drafter stream may hold less than it reads (``resident_params`` below
    ``active_params``): it reuses the target's embedding and lm_head."""
    drafter = {
        "kind": "mtp",
        "weights": [{"precision": "bf16", "active_params": 3e8, "resident_params": 1e8}],
        "layers": [attention(1)],
    }
    dep = build(tmp_path, spec_config(drafter))
    assert dep.resident_weight_bytes == 2_000_000_000 + 200_000_000
    rf = Roofline(dep)
    plain = rf.price(rf.batch_terms([1], [100]))
    first_pass = (3e8 * 2 + 101 * 512) / 1e12
    assert rf.draft_time(plain.roofline, [1], [100], [100], 1) == approx(first_pass)


def test_no_drafting_sequence_costs_no_drafter(tmp_path: Path) -> None:
    dep = build(tmp_path, spec_config({"kind": "fraction", "fraction": 0.1}))
    rf = Roofline(dep)
    assert rf.draft_time(1.0, [100], [0], [], 3) == 0.0
    assert rf.draft_time(1.0, [1], [100], [100], 0) == 0.0
