"""The shipped configs of configs/frontier/: DeepSeek-V3 (MLA, 256 + 1 experts, EP 8 and
data-parallel attention on 8 x H200 / B200, its MTP drafter) and Llama-3.1-8B-Instruct
with an EAGLE drafter. The numbers are the ones the configs' comments derive from the
published configs; an edit that changes one fails here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from inference_lab.core.config import AttentionLayer, MLALayer, load_model_config
from inference_lab.core.roofline import Roofline
from tests.configs_util import CONFIGS, PROFILES

FRONTIER = CONFIGS / "frontier"
DEEPSEEK = FRONTIER / "DeepSeek-V3.toml"
EAGLE = FRONTIER / "Llama-3.1-8B-Instruct-EAGLE.toml"


@pytest.mark.parametrize("path", sorted(FRONTIER.glob("*.toml")), ids=lambda p: p.stem)
def test_each_frontier_config_is_named_after_its_model_and_every_entry_prices(path: Path) -> None:
    cfg = load_model_config(path, PROFILES)
    assert cfg.model.name == path.stem
    for dep in cfg.deployments.values():
        assert dep.total_blocks >= 1
        t = Roofline(dep).step_time(np.ones(4, dtype=np.int64), np.full(4, 100, dtype=np.int64))
        assert 0 < t < 1


def test_deepseek_v3_parameter_counts_add_up_to_the_published_671b() -> None:
    """fp8 669,065,609,216 + bf16 1,960,809,984 = 671,026,419,200 resident; active 36.6e9
    (the published "37B activated"); per expert (summed over the 58 MoE layers) 58 *
    44,040,192; shared (attention, dense MLPs, shared experts) 15,156,838,400."""
    model = load_model_config(DEEPSEEK, PROFILES).model
    fp8, bf16 = model.weights
    assert (fp8.precision, bf16.precision) == ("fp8", "bf16")
    assert fp8.resident_params + bf16.resident_params == 671_026_419_200
    assert fp8.active_params + bf16.active_params == 36_625_618_432
    assert fp8.routing is not None
    routing = fp8.routing
    assert (routing.routed_experts, routing.experts_per_tok, routing.moe_layers) == (256, 8, 58)
    per_expert = (fp8.resident_params - fp8.active_params) / (256 - 8)
    assert per_expert == 58 * 44_040_192
    assert fp8.active_params - 8 * per_expert == 15_156_838_400
    (layer,) = model.layers
    assert isinstance(layer, MLALayer)
    assert (layer.count, layer.heads, layer.kv_latent_dim, layer.rope_dim) == (61, 128, 512, 64)
    assert (layer.qk_nope_dim, layer.v_head_dim, layer.q_latent_dim) == (128, 128, 1536)
    assert (model.hidden_dim, model.max_seq_len) == (7168, 163840)


def test_deepseek_v3_runs_ep8_with_eight_attention_ranks_on_h200_and_b200() -> None:
    """Both entries: tp 8, ep 8, dp_attention 8; each rank a worker with its own KV cache
    of 64-token blocks of 62 MLA layers (61 + the MTP layer) x 1,152 B = 4,571,136 B."""
    cfg = load_model_config(DEEPSEEK, PROFILES)
    assert set(cfg.deployments) == {"h200", "b200"}
    for dep in cfg.deployments.values():
        hw = dep.hardware
        assert (hw.tp, hw.ep, hw.dp_attention, dep.workers) == (8, 8, 8, 8)
        assert dep.block_bytes == 62 * 1152 * 64 == 4_571_136
    # H200: pool floor(141e9 * 8 * 0.9) = 1,015,200,000,000 B; weights held: the dense
    # parts once per rank and the experts once (model and MTP drafter) = 820,511,944,704 B
    h200 = cfg.deployments["h200"]
    assert h200.resident_weight_bytes == 820_511_944_704
    assert h200.kv_bytes == (1_015_200_000_000 - 820_511_944_704) / 8
    assert h200.total_blocks == 5323


def test_deepseek_v3_mtp_drafter_is_one_mla_and_moe_layer_with_085_acceptance() -> None:
    """One draft token per step at 0.85 (DeepSeek-V3 report: 85-90 %); the MTP module's
    11,610,068,224 parameters of its own (README_WEIGHTS.md: 11.5B unique), reading the
    shared lm_head."""
    cfg = load_model_config(DEEPSEEK, PROFILES)
    spec = cfg.speculative
    assert spec is not None
    assert (spec.method, spec.num_speculative_tokens, spec.drafter.kind) == ("mtp", 1, "mtp")
    assert cfg.acceptance_rates == (0.85,)
    assert sum(w.resident_params for w in spec.drafter.weights) == 11_610_068_224
    (layer,) = spec.drafter.layers
    assert isinstance(layer, MLALayer) and layer.count == 1


def test_llama_eagle_is_the_8b_target_with_a_one_layer_draft_head() -> None:
    """The target's streams and layers are Llama-3.1-8B-Instruct's; the EAGLE head holds
    251,670,528 parameters and reads 777,007,104 (with the shared lm_head) per draft
    token; gamma 3 at a constant 0.7."""
    cfg = load_model_config(EAGLE, PROFILES)
    target = load_model_config(CONFIGS / "Llama-3.1-8B-Instruct.toml", PROFILES).model
    assert (cfg.model.weights, cfg.model.layers) == (target.weights, target.layers)
    spec = cfg.speculative
    assert spec is not None
    assert (spec.method, spec.num_speculative_tokens, spec.acceptance_rate) == ("eagle", 3, 0.7)
    (w,) = spec.drafter.weights
    assert (w.precision, w.active_params, w.resident_params) == ("bf16", 777_007_104, 251_670_528)
    (layer,) = spec.drafter.layers
    assert isinstance(layer, AttentionLayer)
    assert (layer.count, layer.heads, layer.head_dim, layer.kv_heads) == (1, 32, 128, 8)
    assert set(cfg.deployments) == {"b200", "h200", "h100"}
